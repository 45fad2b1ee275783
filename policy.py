"""The policy and the critic: loading any Hugging Face causal LM, or building the embedded tiny one offline.

This is its own file (not in rollout.py or train.py) because four entry points share it (train, eval, SFT,
bench) and because the tiny policy is a small concept of its own: a real Qwen2-architecture `transformers`
model with a word-level tokenizer built from the environments' texts, warmed up on random-action
trajectories so that, like the paper's instruct model (Qwen2.5-0.5B-Instruct, section 3.2), it starts out
knowing the answer format but not the task.

Device, dtype, threads and the attention kernel are decided here and nowhere else: CUDA if present else CPU
(`--device` overrides), fp32 master weights, bf16 autocast on CUDA only, no cuDNN attention (`setup_device`).

Deviations from the paper / RAGEN (deliberate):
1. `--model tiny` (default) is ~1M parameters and its vocabulary is the environments' own words: the paper's
   0.5B model cannot be downloaded or trained in minutes on a 2-core CPU. The Qwen path is one flag away.
2. The tiny policy's "pre-training + instruction tuning" is one language-model warm-up on random agents'
   conversations, rendered as rollout.py renders them (both think modes, whole and windowed), with the loss on
   the replies plus the same loss on everything else (boards, feedback), as a pre-trained LM has modelled
   text (a prior trained on the replies alone could not read a board's columns: docs/history.md). It knows
   the format, the action words and the boards, not the tasks (`python bench.py prior`).
3. The tiny tokenizer is word-level, and each tag with its leading space is one token (" </think>", " ||"):
   with a separate " " token before every tag, replies were well-formed in 1-5% of turns; with these, 100%.
4. The critic is a separate copy of the policy backbone with a scalar head (as RAGEN/verl), but its head is
   initialised to zero so that the first value estimates are 0 rather than noise.
5. On CPU the default is 1 intra-op thread: measured on these 2-core machines, small-model forward+backward
   with 2 threads was erratic and up to 10x slower (bench.py prints the current figure).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import random
import re
import shutil
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn

TINY_VERSION = 3  # bump to force a rebuild of cached tiny policies after a change of the warm-up itself
TINY_MODEL = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
                  tie_word_embeddings=True)
# 100 steps (a micro-batch of every env per step) at peak lr 6e-3, ~90 s on one thread: well-formed replies in
# >= 97% of turns on every env (`python bench.py prior`). obs_weight: the loss on what it reads (deviation 2).
TINY_WARMUP = dict(episodes_per_env=240, steps=100, batch=32, batch_tokens=6144, lr=6e-3, seed=0, obs_weight=1.0)
SPECIAL = dict(pad="<|endoftext|>", bos="<|im_start|>", eos="<|im_end|>", unk="<unk>")
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
# Word-level pieces: a capitalised or lower-case word, one capital letter (grid symbols), one digit, the action
# separator "||", any other single character, each optionally with its leading space; "\n" is kept (grid rows
# must not merge). Tags, like words, carry their leading space (" </think>" is one token, see build_tokenizer).
PIECE = r" ?[A-Z][a-z]+| ?[a-z]+| ?[A-Z]| ?\d| ?\|\|| ?[^\sA-Za-z\d]|\n| "
GENERIC_TOKENIZERS = ("PreTrainedTokenizerFast", "TokenizersBackend")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


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


def setup_device(device: torch.device, threads: int = 1) -> None:
    """Process-wide settings for this device: intra-op threads on CPU (deviation 5); on CUDA, no cuDNN attention.

    torch 2.11's CUDA builds prefer cuDNN's attention kernels on Hopper GPUs (H100, H200: the cuDNN they bundle
    passes torch's version gate), and cuDNN builds an execution graph for every new sequence length it meets. Here
    every shape is new: each decode step lengthens the KV cache, each turn's prefill and each micro-batch has its
    own length. Measured on an H200 (torch 2.11, random Qwen2.5-0.5B shapes, bf16): 2.5 ms of host time per
    attention call and ~95 ms per forward step at any batch size, 2/3 of it in attention. Flash / memory-efficient
    attention (torch's choice before) compute the same attention without a per-shape build."""
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


def load_policy(name: str = "tiny", device: torch.device | str = "cpu", cache_dir: str | None = None,
                progress: bool = True, tiny: dict | None = None, flag_name: str = "--model"):
    """-> (model, tokenizer, path). `name`: "tiny", a hub id (e.g. Qwen/Qwen2.5-0.5B-Instruct) or a folder.

    `tiny`: overrides for ensure_tiny (warmup=, model_cfg=, envs=), e.g. the tests' small build. Any failure to
    read the model is a ValueError naming `flag_name`, the folder and what went wrong (a truncated safetensors
    file, a config that is not JSON, ...).
    """
    from transformers import AutoModelForCausalLM
    path, local = (ensure_tiny(cache_dir, progress=progress, **(tiny or {})), True) if name == "tiny" else \
        resolve_model(name, flag_name)
    try:
        tok = tokenizer_class(path).from_pretrained(path, local_files_only=local)
        model = _from_pretrained(AutoModelForCausalLM, path, local_files_only=local)
    except Exception as e:  # the files are the user's input: whatever is wrong with them, say it in one line
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        raise ValueError(f"{flag_name} {name!r}: cannot load a causal LM and its tokenizer from {path} "
                         f"({type(e).__name__}: {first})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if tok.chat_template is None:
        raise ValueError(f"{flag_name} {name!r}: its tokenizer has no chat template (use an instruct model)")
    return model.to(device), tok, str(path)


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
        self.backbone.save_pretrained(path)
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


# ----------------------------------------------------------------------------- the tiny policy

def tiny_envs() -> list[str]:
    from envs import ENVS
    return sorted(ENVS)


def tiny_corpus(envs: list[str], episodes: int, seed: int):
    """Random-agent conversations (text only) for every env, think mode and history window."""
    from rollout import RolloutConfig, rollout, random_agent
    rng = random.Random(seed)
    for env in envs:
        for think in (True, False):
            cfg = RolloutConfig(think=think)
            seeds = [rng.randrange(1000, 2**31) for _ in range(episodes // 2)]
            trajs = rollout(env, seeds, list(range(len(seeds))), cfg, agent=random_agent(rng),
                            samples=[rng.randrange(16) for _ in seeds])
            yield env, think, seeds, trajs


def build_tokenizer(texts: list[str], size: int | None = None):
    """A word-level `transformers` tokenizer whose vocabulary is every piece of `texts`; decoding is exact.
    `size`: pad the vocabulary to this many entries with pieces no text splits into ("¤0", "¤1", ...), for a
    model of a given vocabulary size (bench.py gpu)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    spaced = [" " + t for t in TAGS]
    tags = re.compile("|".join(re.escape(t) for t in spaced + TAGS))
    pieces = {p for t in texts for part in tags.split(t) for p in re.findall(PIECE, part)} | {" ", "\n"}
    # a symbol the legend shows spaced (" √ box on target") may appear in a grid only unspaced, in a state the
    # random agent never reached (a box on target in sokoban-newvocab's "C"): keep both forms, never <unk>
    pieces = sorted(pieces | {p[1:] for p in pieces if len(p) == 2 and p[0] == " "})
    vocab = {tok: i for i, tok in enumerate([SPECIAL["unk"], SPECIAL["pad"], SPECIAL["bos"], SPECIAL["eos"]]
                                            + TAGS + spaced + pieces)}
    if size is not None and size < len(vocab):
        raise ValueError(f"vocabulary size {size}: the texts alone need {len(vocab)} entries")
    vocab.update({f"¤{i}": len(vocab) + i for i in range((size or 0) - len(vocab))})
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL["unk"]))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(PIECE), behavior="isolated")
    core.decoder = decoders.Fuse()  # pieces carry their own spaces: concatenation restores the text exactly
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token=SPECIAL["unk"], pad_token=SPECIAL["pad"],
                                  bos_token=SPECIAL["bos"], eos_token=SPECIAL["eos"],
                                  clean_up_tokenization_spaces=False)
    # Already in the vocabulary; adding them makes them match whole before pre-tokenisation (longest first, so
    # " </think>" wins over " " + "</think>"). With the space inside the tag, the token before every tag in a
    # reply is a different one (" </think>" after the thought, " <answer>" after it, " </answer>" after the last
    # action) rather than a shared " ": the format becomes a chain of bigrams that a tiny model learns in few
    # steps (measured: see TINY_WARMUP).
    tok.add_tokens(TAGS + spaced)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def ensure_tiny(cache_dir: str | None = None, progress: bool = True, warmup: dict | None = None,
                model_cfg: dict | None = None, envs: list[str] | None = None) -> str:
    """Path of the cached tiny policy, building it first if its vocabulary or config changed."""
    warmup = {**TINY_WARMUP, **(warmup or {})}
    model_cfg = {**TINY_MODEL, **(model_cfg or {})}
    envs = envs or tiny_envs()
    texts, data = [], []
    for env, think, seeds, trajs in tiny_corpus(envs, warmup["episodes_per_env"], warmup["seed"]):
        data.append((env, think, seeds))
        for t in trajs:
            texts += [m["content"] for m in t.messages]
    # + what the rollout writes that random agents never trigger (they are always valid: no penalty feedback)
    from rollout import PENALTY_NOTE
    tok_texts = texts + [f"{m}\n" for m in ("system", "user", "assistant")] + [" ".join(TAGS)] + \
        [f"Reward: -0.1\n{PENALTY_NOTE}"]
    tok = build_tokenizer(tok_texts)
    # the key: everything the build depends on (the corpus texts, hence the envs and the rollout's rendering;
    # the vocabulary, hence the tokenizer code; config, warm-up settings; TINY_VERSION for the warm-up code; the
    # transformers major version, whose 4.x cannot read the tokenizer folder 5.x writes)
    import transformers
    key = hashlib.sha256(json.dumps([TINY_VERSION, model_cfg, warmup, envs, sorted(set(tok_texts)),
                                     sorted(tok.get_vocab().items()), transformers.__version__.split(".")[0]],
                                    sort_keys=True).encode()).hexdigest()[:12]
    root = Path(cache_dir or os.environ.get("RAGEN_MINI_CACHE", Path.home() / ".cache" / "ragen-mini"))
    path = root / f"tiny-{key}"
    if (path / "config.json").exists():
        return str(path)
    model = warm_up(tok, data, model_cfg, warmup, progress)
    import transformers
    transformers.utils.logging.disable_progress_bar()  # its "Writing model shards" bar says nothing here
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix=".tmp-"))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        os.replace(tmp, path)  # atomic: a concurrent or interrupted build never leaves a half-written cache
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)  # another process won the race; its copy is identical
    return str(path)


def warm_up(tok, data, model_cfg: dict, warmup: dict, progress: bool):
    """Language-model warm-up on random-agent trajectories: mean NLL of the sampled (mask = 1) tokens plus
    `obs_weight` x mean NLL of the other real tokens (the observations and the template)."""
    from tqdm import tqdm
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from rollout import RolloutConfig, rollout, random_agent
    torch.manual_seed(warmup["seed"])
    cfg = Qwen2Config(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, **model_cfg)
    model = Qwen2ForCausalLM(cfg)
    rng = random.Random(warmup["seed"] + 1)
    pools: dict[str, list] = {}  # env -> its segments, sorted by length
    for env, think, seeds in data:
        for ctx in (0, 1):  # full conversations (3/4 of the seeds) and a 1-turn window (1/4)
            part = [s for j, s in enumerate(seeds) if (j % 4 == 3) == (ctx == 1)]
            trajs = rollout(env, part, list(range(len(part))), RolloutConfig(think=think, context_turns=ctx),
                            tokenizer=tok, agent=random_agent(rng), samples=[rng.randrange(16) for _ in part])
            pools.setdefault(env, []).extend(s for t in trajs for s in t.segments)
    for segs in pools.values():
        segs.sort(key=lambda s: len(s.input_ids))
    names = sorted(pools)
    opt = torch.optim.AdamW(model.parameters(), lr=warmup["lr"], weight_decay=0.01)
    steps = warmup["steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(  # 10 warm-up steps, then cosine down to 10% of the peak
        opt, lambda s: min(1.0, (s + 1) / 10) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps))))
    budget = max(1, warmup["batch_tokens"] // len(names))   # tokens per env and step
    model.train()
    t0 = time.time()
    bar = tqdm(range(steps), desc="tiny policy warm-up", disable=not progress)
    for step in bar:
        # Every step sees every env: one micro-batch of length-neighbours (little padding) per env, gradients
        # accumulated. Measured: one env per step in turn (the first version) left the replies unconditioned
        # on the env (Sokoban moves in Bandit, clicks on WebShop's search page), as each step pulled the
        # shared weights towards one env's answer distribution.
        batches = []
        for env in names:
            segs = pools[env]
            start = rng.randrange(len(segs))
            n = max(1, min(warmup["batch"], budget // len(segs[start].input_ids)))
            batches.append(pad_segments(segs[max(0, start - n + 1):start + 1], tok.pad_token_id))
        # two token means over the whole step: the replies, and everything else the model reads (observations)
        n_sampled = sum(m[:, 1:].sum() for _, _, m in batches)
        n_obs = sum((a[:, 1:] * (1 - m[:, 1:])).sum() for _, a, m in batches)
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for ids, attn, mask in batches:
            logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()   # [B, T-1, V]
            nll = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")  # [B, T-1]
            obs = attn[:, 1:] * (1 - mask[:, 1:])                                                   # [B, T-1]
            loss = (nll * mask[:, 1:]).sum() / n_sampled + warmup["obs_weight"] * (nll * obs).sum() / n_obs
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 10 == 0 or step == steps - 1:
            bar.set_postfix(loss=f"{total.item():.3f}", s=f"{time.time() - t0:.0f}")
    model.eval()
    return model


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
