"""The policy and the critic: loading any Hugging Face causal LM, or the shipped tiny prior (`prior/`).

This is its own file (not in rollout.py or train.py) because four entry points share it (train, eval, SFT,
bench). `--model tiny` loads `prior/`: a real Qwen2-architecture `transformers` model with a word-level
tokenizer, which like the paper's instruct model (Qwen2.5-0.5B-Instruct, section 3.2) knows the answer format
but not the task; prior.py says how it was built and rebuilds it.

Device, dtype, threads and the attention kernel are decided here and nowhere else: CUDA if present else CPU
(`--device` overrides), fp32 master weights, bf16 autocast on CUDA only, no cuDNN attention (`setup_device`).

Deviations from the paper / RAGEN (deliberate):
1. The critic is a separate copy of the policy backbone with a scalar head (as RAGEN/verl), but its head is
   initialised to zero so that the first value estimates are 0 rather than noise.
2. On CPU the default is 1 intra-op thread: measured on these 2-core machines, small-model forward+backward
   with 2 threads was erratic and up to 10x slower (bench.py prints the current figure).
"""
from __future__ import annotations

import json
import os
import re
from pathlib import Path

import torch
import torch.nn as nn

PRIOR_DIR = Path(__file__).resolve().parent / "prior"  # the shipped tiny policy (prior.py built it)
GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")


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


def autocast_dtype(device: torch.device):
    """bf16 autocast on CUDA only; CPU runs in fp32."""
    return torch.bfloat16 if device.type == "cuda" else None


def setup_device(device: torch.device, threads: int = 1, memory_cap: float | None = None) -> None:
    """Process-wide settings for this device: intra-op threads on CPU (deviation 2); on CUDA, no cuDNN attention.

    torch 2.11's CUDA builds prefer cuDNN's attention kernels on Hopper GPUs (H100, H200: the cuDNN they bundle
    passes torch's version gate), and cuDNN builds an execution graph for every new sequence length it meets. Here
    every shape is new: each decode step lengthens the KV cache, each turn's prefill and each micro-batch has its
    own length. Measured on an H200 (torch 2.11, random Qwen2.5-0.5B shapes, bf16): 2.5 ms of host time per
    attention call and ~95 ms per forward step at any batch size, 2/3 of it in attention. Flash / memory-efficient
    attention (torch's choice before) compute the same attention without a per-shape build."""
    if memory_cap is not None:  # GiB; proves on a large card that a run fits a smaller one (the allocator refuses)
        if device.type != "cuda":
            raise ValueError(f"--memory-cap {memory_cap:g}: caps CUDA memory; this run is on {device.type}")
        total = torch.cuda.get_device_properties(device).total_memory
        if memory_cap * 2 ** 30 > total:
            raise ValueError(f"--memory-cap {memory_cap:g}: larger than this card's {total / 2 ** 30:.1f} GiB "
                             f"({torch.cuda.get_device_name(device)})")
        torch.cuda.set_per_process_memory_fraction(memory_cap * 2 ** 30 / total, device)
    if device.type == "cpu":
        torch.set_num_threads(threads)
    elif device.type == "cuda":
        torch.backends.cuda.enable_cudnn_sdp(False)


def _from_pretrained(cls, path, **kw):
    """fp32 weights on transformers 4.x (`torch_dtype`) and 5.x (`dtype`, whose default is the checkpoint's).
    transformers 5's per-load progress bars are switched off: they said nothing for models that load in a second,
    and they buried the scripts' one-line messages."""
    import transformers
    transformers.utils.logging.disable_progress_bar()
    key = "dtype" if int(transformers.__version__.split(".")[0]) >= 5 else "torch_dtype"
    return cls.from_pretrained(path, **{key: torch.float32}, **kw)


# ----------------------------------------------------------------------------- loading

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


def resolve_model(name: str, flag_name: str = "--model") -> tuple[str, bool]:
    """Where `name` loads from -> (path or hub id, local_files_only), or a ValueError that says what to do.

    An existing folder is used as it is; a path-shaped name (absolute, ./, ~, or more than one "/") that does not
    exist is a missing folder. A hub id ("org/name") loads from the local Hugging Face cache when the hub cannot
    be reached, and fails in seconds when the cache lacks it (transformers alone retries for about a minute)."""
    path = Path(name).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"{flag_name} {name!r}: is a file; pass the folder that holds config.json")
        return str(path), True
    if name.startswith(("/", ".", "~")) or name.count("/") != 1 or not all(name.split("/")):
        raise ValueError(f"{flag_name} {name!r}: no such folder (and not a hub id of the form org/name)")
    from huggingface_hub import try_to_load_from_cache
    cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    if hub_reachable():
        return name, False
    if not cached:
        raise ValueError(f"{flag_name} {name!r}: not in the local Hugging Face cache, and the hub cannot be reached "
                         f"from this machine: download it first (huggingface-cli download {name}) or pass a "
                         f"local folder")
    return name, True


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


def load_policy(name: str = "tiny", device: torch.device | str = "cpu", flag_name: str = "--model"):
    """-> (model, tokenizer, path). `name`: "tiny" (the shipped prior, `prior/`), a hub id (e.g.
    Qwen/Qwen2.5-0.5B-Instruct) or a folder. Any failure to read the model is a ValueError naming `flag_name` and
    the file that could not be read (a truncated safetensors file, a config that is not JSON, ...)."""
    from transformers import AutoModelForCausalLM
    if name == "tiny" and not (PRIOR_DIR / "config.json").is_file():
        raise ValueError(f"{flag_name} tiny: the shipped prior is missing from {PRIOR_DIR} (restore it with git "
                         f"checkout, or rebuild it: python prior.py --out {PRIOR_DIR})")
    path, local = (str(PRIOR_DIR), True) if name == "tiny" else resolve_model(name, flag_name)
    what = "its tokenizer"
    try:
        tok = tokenizer_class(path).from_pretrained(path, local_files_only=local)
        what = "the model"
        model = _from_pretrained(AutoModelForCausalLM, path, local_files_only=local)
    except Exception as e:  # the files are the user's input: whatever is wrong with them, say it in one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        where = bad_file(path, what) if local else path
        raise ValueError(f"{flag_name} {name!r}: cannot load {what} from {where} ({type(e).__name__}: {first})") \
            from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ValueError(f"{flag_name} {name!r}: its tokenizer has no chat template (use an instruct model)")
    return model.to(device), tok, str(path)


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
    """AutoTokenizer, except for a folder that declares a generic fast tokenizer (the tiny policy's).

    transformers 5 maps model_type "qwen2" to Qwen2Tokenizer and rebuilds a byte-level BPE from the vocabulary,
    ignoring the saved word-level tokenizer.json; PreTrainedTokenizerFast loads that file as it is (4.x and 5.x).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    cfg = Path(path) / "tokenizer_config.json"
    if cfg.exists() and json.loads(cfg.read_text()).get("tokenizer_class") in GENERIC_TOKENIZERS:
        return PreTrainedTokenizerFast
    return AutoTokenizer


class Critic(nn.Module):
    """PPO's value model: the policy's backbone (a separate copy) + a scalar head.

    values[:, t] is the value of the state just before token t is sampled (read from the hidden state at t-1),
    aligned with the log-prob convention of starpo.token_logprobs.
    """

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
        v = self.value_head(h).squeeze(-1).float()                                               # [B, T]
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)

    def save_pretrained(self, path: str) -> None:
        from lora import plain_state_dict
        self.backbone.save_pretrained(path, state_dict=plain_state_dict(self.backbone))
        torch.save(self.value_head.state_dict(), Path(path) / "value_head.pt")


def load_critic(path: str, device: torch.device | str = "cpu") -> Critic:
    """The same loader as the policy: a causal-LM checkpoint gives the backbone (its LM head is dropped)."""
    from transformers import AutoModel
    head = Path(path) / "value_head.pt"
    try:
        local = Path(path).is_dir() or not hub_reachable()
        critic = Critic(_from_pretrained(AutoModel, path, local_files_only=local))
        if head.exists():
            critic.value_head.load_state_dict(torch.load(head, map_location="cpu"))
    except Exception as e:  # a checkpoint the user pointed at: say which file is wrong, in one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ValueError(f"cannot load the critic from {path} ({type(e).__name__}: {first})") from None
    return critic.to(device)


def pad_segments(segs, pad_id: int):
    """Right-pad segments -> input_ids [B, T], attention_mask [B, T], loss_mask [B, T] (float)."""
    T = max(len(s.input_ids) for s in segs)
    ids = torch.full((len(segs), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(segs), T), dtype=torch.long)
    mask = torch.zeros((len(segs), T))
    for i, s in enumerate(segs):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float)
    return ids, attn, mask
