"""The priors a run starts from: the tiny policy in `prior/` (how it was built), and a real LM's warm start.

    python tools/prior.py --out prior-rebuilt        # ~3 min on one CPU thread; prints each env's format rate
    python tools/prior.py --model models/smollm2-135m-instruct --out models/smollm2-warm  # ~9 min, 2 cores

The paper starts from Qwen2.5-0.5B-Instruct (section 3.2): a model that knows the answer format but not the
tasks. The tiny prior plays that part on a CPU: a real Qwen2-architecture model (~1M parameters), a word-level
tokenizer built from the environments' texts, warmed up on random agents' conversations rendered as rollout.py
renders them (both think modes, whole and windowed; the loss on the replies and on the boards). Shipped in
`prior/` (~4 MB): float rounding differs between CPUs, so every machine starts from the same weights;
`ensure_tiny` builds small variants for the tests and for new envs. The warm start (`--model`, `warm_start`)
teaches a pretrained instruct LM the format and the valid actions on the same conversations (LoRA, replies
only; its thought is the random agent's fixed sentence: see WARM), saved as a plain model folder for eval.py
and train.py; after Ctrl-C the same command continues from its checkpoint in OUT.partial.
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
from dataclasses import dataclass
from pathlib import Path

# A warm start on all cores while other work runs too. Measured on 2 cores (SmolLM2, a step in 2 micro-
# batches): libgomp's default, spinning wait took ~6.4 s a step on idle cores but 30-40 s while another
# process held a core (170 s at worst, one sequence at a time); waiting passively, 7.6 s idle and 10-13 s
# beside that process. OpenMP reads this when torch loads, hence here; a value already set wins. The tiny
# prior runs on one thread: no parallel region, no effect.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

import sys

# the repository root, for python tools/prior.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import cli  # noqa: E402
from engine.logprobs import pad_segments  # noqa: E402
from engine.models import DTYPES, PRIOR_DIR, default_threads  # noqa: E402

TINY_VERSION = 3  # part of ensure_tiny's cache key: bump after a change of the warm-up code itself
TINY_MODEL = dict(hidden_size=128, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=4096, rope_theta=10000.0,
                  tie_word_embeddings=True)
# 200 steps (a micro-batch of every env per step) at peak lr 6e-3, ~3 min on one thread: well-formed replies
# and valid actions in ~100% of turns on every env. With 100 (the build before the prior was shipped) a build
# on one CPU answered Bandit with a valid arm in 20% of turns. obs_weight: the loss on what it reads (a prior
# trained on the replies alone could not read a board's columns).
TINY_WARMUP = dict(episodes_per_env=240, steps=200, batch=32, batch_tokens=6144, lr=6e-3, seed=0,
                   obs_weight=1.0)
SPECIAL = dict(pad="<|endoftext|>", bos="<|im_start|>", eos="<|im_end|>", unk="<unk>")
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
# Word-level pieces: a capitalised or lower-case word, one capital letter (grid symbols), one digit, the
# action separator "||", any other single character, each optionally with its leading space; "\n" is kept
# (grid rows must not merge). Tags, like words, carry their leading space (" </think>" is one token, see
# build_tokenizer).
PIECE = r" ?[A-Z][a-z]+| ?[a-z]+| ?[A-Z]| ?\d| ?\|\|| ?[^\sA-Za-z\d]|\n| "
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")



def random_agent_fn():
    """The random agent (every eval's floor): engine.agents.random_agent, or eval.random_agent where the
    project's refactor moved it."""
    try:
        from engine.agents import random_agent
    except ImportError:
        from eval import random_agent
    return random_agent


def tiny_envs() -> list[str]:
    from envs import ENVS
    return sorted(ENVS)


def tiny_corpus(envs: list[str], episodes: int, seed: int):
    """Random-agent conversations (text only) for every env, think mode and history window."""
    random_agent = random_agent_fn()
    from rollout import RolloutConfig, rollout
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
    model of a given vocabulary size (tools/bench.py gpu)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    spaced = [" " + t for t in TAGS]
    tags = re.compile("|".join(re.escape(t) for t in spaced + TAGS))
    pieces = {p for t in texts for part in tags.split(t) for p in re.findall(PIECE, part)} | {" ", "\n"}
    # a symbol the legend shows spaced (" √ box on target") may appear in a grid only unspaced, in a state
    # the random agent never reached (a box on target in sokoban-newvocab's "C"): keep both forms, never <unk>
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
    # Already in the vocabulary; adding them makes them match whole before pre-tokenisation (longest first,
    # so " </think>" wins over " " + "</think>"). With the space inside the tag, the token before every tag in
    # a reply is a different one (" </think>" after the thought, " <answer>" after it, " </answer>" after the
    # last action) rather than a shared " ": the format becomes a chain of bigrams that a tiny model learns in
    # few steps (measured: see TINY_WARMUP).
    tok.add_tokens(TAGS + spaced)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def corpus(warmup: dict, envs: list[str]):
    """-> (tokenizer, warm-up data [(env, think, seeds)], the tokenizer's texts) for these settings."""
    texts, data = [], []
    for env, think, seeds, trajs in tiny_corpus(envs, warmup["episodes_per_env"], warmup["seed"]):
        data.append((env, think, seeds))
        for t in trajs:
            texts += [m["content"] for m in t.messages]
    # + what the rollout writes that random agents never trigger (they are always valid: no penalty feedback)
    from rollout import PENALTY_NOTE
    tok_texts = texts + [f"{m}\n" for m in ("system", "user", "assistant")] + [" ".join(TAGS)] + \
        [f"Reward: -0.1\n{PENALTY_NOTE}"]
    return build_tokenizer(tok_texts), data, tok_texts


def settings(warmup: dict | None, model_cfg: dict | None, envs: list[str] | None):
    """The shipped recipe's settings with these overrides -> (warm-up, model config, envs)."""
    return {**TINY_WARMUP, **(warmup or {})}, {**TINY_MODEL, **(model_cfg or {})}, envs or tiny_envs()


def build(warmup: dict | None = None, model_cfg: dict | None = None, envs: list[str] | None = None,
          progress: bool = True):
    """The whole recipe: corpus, tokenizer, warm-up. -> (model, tokenizer)."""
    warmup, model_cfg, envs = settings(warmup, model_cfg, envs)
    tok, data, _ = corpus(warmup, envs)
    return warm_up(tok, data, model_cfg, warmup, progress), tok


def ensure_tiny(cache_dir: str, progress: bool = True, warmup: dict | None = None,
                model_cfg: dict | None = None, envs: list[str] | None = None) -> str:
    """A tiny policy built with these settings in `cache_dir` (the tests' small builds, an added env's prior):
    the folder's name is a hash of everything the build depends on, so a second call with the same settings is
    a cache hit and a changed setting is a new build. -> its path."""
    warmup, model_cfg, envs = settings(warmup, model_cfg, envs)
    tok, data, tok_texts = corpus(warmup, envs)
    # the key: everything the build depends on (the corpus texts, hence the envs and the rollout's rendering;
    # the vocabulary, hence the tokenizer code; config, warm-up settings; TINY_VERSION for the warm-up code;
    # the transformers major version, whose 4.x cannot read the tokenizer folder 5.x writes)
    import transformers
    key = hashlib.sha256(json.dumps([TINY_VERSION, model_cfg, warmup, envs, sorted(set(tok_texts)),
                                     sorted(tok.get_vocab().items()), transformers.__version__.split(".")[0]],
                                    sort_keys=True).encode()).hexdigest()[:12]
    path = Path(cache_dir) / f"tiny-{key}"
    if not (path / "config.json").exists():
        try:  # atomic: a concurrent or interrupted build never leaves a half-written cache
            save(warm_up(tok, data, model_cfg, warmup, progress), tok, path)
        except OSError:
            pass  # another process won the race; its copy is identical
    return str(path)


def warm_up(tok, data, model_cfg: dict, warmup: dict, progress: bool):
    """Language-model warm-up on random-agent trajectories: mean NLL of the sampled (mask = 1) tokens plus
    `obs_weight` x mean NLL of the other real tokens (the observations and the template)."""
    from tqdm import tqdm
    from transformers import Qwen2Config, Qwen2ForCausalLM
    random_agent = random_agent_fn()
    from rollout import RolloutConfig, rollout
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
            nll = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:],
                                              reduction="none")  # [B, T-1]
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

# ----------------------------------------------------------------------------- python tools/prior.py

# what `save` writes: --overwrite replaces only these
PRIOR_FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
               "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


def save(model, tok, out: Path) -> None:
    """Write the prior as a plain `save_pretrained` folder, atomically (a temp folder renamed into place)."""
    import transformers
    transformers.utils.logging.disable_progress_bar()  # its "Writing model shards" bar says nothing here
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-prior-"))
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        portable(tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def portable(folder: Path) -> None:
    """Make a folder that transformers 5 wrote readable, with the same meaning, by transformers 4.46+ (the
    range requirements.txt allows): 4.x reads `rope_theta` (5.x nests it in `rope_parameters`; without it 4.x
    would silently use Qwen2's default 1e6), knows no `TokenizersBackend` class, and reads the chat template
    from tokenizer_config.json. 5.x reads both spellings."""
    cfg_file, tok_file = folder / "config.json", folder / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    if "rope_parameters" in cfg and "rope_theta" not in cfg:
        cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    cfg.setdefault("torch_dtype", cfg.get("dtype", "float32"))
    cfg_file.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    tcfg = json.loads(tok_file.read_text())
    tcfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tcfg.pop("backend", None)
    tcfg["chat_template"] = CHAT_TEMPLATE
    tok_file.write_text(json.dumps(tcfg, indent=2, sort_keys=True) + "\n")


def format_rates(path: str, prompts: int = 32) -> dict[str, float]:
    """Fraction of well-formed replies of the prior in `path` on each env (32 eval prompts at temperature
    0.5): what a working prior must have, whatever CPU built it."""
    from engine.models import load_policy
    from envs import EVAL_SEEDS
    from rollout import RolloutConfig, rollout
    model, tok, _ = load_policy(path)
    rates = {}
    for env in tiny_envs():
        trajs = rollout(env, EVAL_SEEDS[:prompts], list(range(prompts)), RolloutConfig(temperature=0.5),
                        tokenizer=tok, model=model.eval(), generator=torch.Generator().manual_seed(0))
        turns = [x for t in trajs for x in t.turns]
        rates[env] = sum(x.parsed for x in turns) / max(1, len(turns))
    return rates


# ----------------------------------------------------------------------------- the warm start (--model)

# What the warm start teaches a pretrained instruct LM (untrained, SmolLM2-135M-Instruct answers in format
# in 13-32% of turns and never with a valid action): the answer format and the valid actions of Bandit,
# Sokoban and FrozenLake, nothing about winning. It imitates the random agent, so its moves are uniform among
# the valid ones (success near the random agent's; in Bandit its name prior picks the arm) and its <think>
# thought is the random agent's one fixed sentence, "I pick my moves at random.": the Echo Trap's template
# metrics (extras/collapse.py) must read that single template as the starting point of a run, not as a
# collapse.
# The recipe measured in issue 65: LoRA r16 / alpha 32 (engine/lora.py), AdamW 5e-4, 60 steps of 3 Bandit +
# 2 Sokoban + 2 FrozenLake segments, bf16 autocast where the CPU has native bf16.
WARM = dict(lora_rank=16, lora_alpha=32.0, lr=5e-4, steps=60, warmup_steps=5, window_share=0.25,
            max_new_tokens=60, save_every=5, format_prompts=16)
# max_new_tokens: the random agent's longest reply is 25 SmolLM2 tokens (a thought and 5 actions), so 60
# cuts a stray reply off early instead of at the hub default of 400-500 (eval.py and train.py read it from
# the folder's train_config.json; a flag still wins). window_share: the 1-turn windows' share of the
# segments, as the tiny prior's 1/4 (eval.py's default is the whole conversation).
WARM_MIX = {"bandit": 3, "sokoban": 2, "frozenlake": 2}  # segments per step (Bandit: one short turn each)
WARM_VERSION = 1  # in the checkpoint's settings: bump after a change of the recipe's code, so none resumes


def warm_batch(tok, seed: int, step: int) -> list:
    """Step `step`'s segments (rollout.Segment): WARM_MIX random-agent episodes per env, each in a random
    think mode, as the whole conversation (3/4) or the 1-turn window of one random turn (1/4), rendered by
    rollout.py with the model's own tokenizer. Drawn from (seed, step) alone: a resumed run draws what it
    would have drawn."""
    from rollout import RolloutConfig, rollout
    random_agent = random_agent_fn()
    rng = random.Random(f"warm start {seed} {step}")
    segs = []
    for env, count in WARM_MIX.items():
        for _ in range(count):
            window = rng.random() < WARM["window_share"]
            cfg = RolloutConfig(think=rng.random() < 0.5, context_turns=1 if window else 0)
            # a training seed, far from eval's (envs.EVAL_SEEDS: 123-378)
            traj, = rollout(env, [rng.randrange(1000, 2**31)], [0], cfg, tokenizer=tok,
                            agent=random_agent(rng), samples=[rng.randrange(16)])
            segs.append(rng.choice(traj.segments))
    return segs


def micro_batches(segs: list) -> list[list]:
    """A step's segments as at most two padded micro-batches of length neighbours, split where the fewest pad
    tokens are computed. Fewer, larger passes than one sequence at a time (measured, 2 cores, SmolLM2): ~15%
    faster on idle cores, 3x faster while another process holds a core, as every op ends in a barrier of
    the threads."""
    segs = sorted(segs, key=lambda s: len(s.input_ids))
    lengths = [len(s.input_ids) for s in segs]

    def computed(k: int) -> int:  # tokens through the model with the first k segments in the first batch
        return k * lengths[k - 1] + (len(segs) - k) * lengths[-1]
    k = min(range(1, len(segs) + 1), key=computed)
    return [part for part in (segs[:k], segs[k:]) if part]


def reply_nll(model, segs: list, pad_id: int, amp) -> torch.Tensor:
    """Summed NLL of the reply tokens of `segs` (loss_mask 1: what the agent wrote; the boards, feedback and
    template are read, not learned), right-padded into one batch. No attention mask: under the causal mask no
    real token attends to a pad that follows it (and sdpa keeps its causal kernel). The LM head runs only on
    the positions that predict a reply token: with SmolLM2's 49k-word head, on every position it would cost
    ~20% of the step for ~10% of the tokens. Llama and Qwen2 scale no logits, so these are the model's own."""
    device = next(model.parameters()).device
    ids, _, mask = pad_segments(segs, pad_id)                         # [B, T] each
    ids = ids.to(device)
    wanted = mask[:, 1:].bool().to(device)                            # [B, T-1]: predicts a reply token
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        hidden = model.base_model(input_ids=ids).last_hidden_state[:, :-1][wanted]   # [n, H]
        logits = model.get_output_embeddings()(hidden)                                # [n, V]
    return nn.functional.cross_entropy(logits.float(), ids[:, 1:][wanted], reduction="sum")


def frozen_in(model, amp) -> list:
    """Cast the frozen base weight of every LoRA layer to `amp` once (autocast would cast it again at every
    forward: measured 17% of a bf16 step; the numbers are the same). -> [(layer, its fp32 weight)] for
    `frozen_back`, so that the adapters merge into the exact fp32 weights."""
    from engine.lora import LoRALinear
    if amp is None:
        return []
    kept = []
    for m in model.modules():
        if isinstance(m, LoRALinear):
            kept.append((m.base, m.base.weight.data))
            m.base.weight.data = m.base.weight.data.to(amp)
    return kept


def frozen_back(kept: list) -> None:
    for layer, weight in kept:
        layer.weight.data = weight


def warm_settings(cfg, model_path: str, amp) -> dict:
    """Everything the warm start's numbers depend on: a checkpoint resumes only with the same."""
    local = Path(model_path)
    return dict(version=WARM_VERSION, model=str(local.resolve()) if local.exists() else model_path,
                seed=cfg.seed, steps=cfg.steps, lr=cfg.lr, lora_rank=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
                dtype="bf16" if amp is not None else "fp32", mix=WARM_MIX,
                window_share=WARM["window_share"], warmup_steps=WARM["warmup_steps"])


def read_partial(partial: Path, settings: dict, out: str) -> dict | None:
    """The checkpoint of an interrupted warm start into `out` (`partial`: OUT.partial/state.pt), or None when
    there is none. One with other settings, or one that cannot be read, is a ValueError saying what to do."""
    fresh = f"remove {partial} to start afresh"
    if not partial.exists() or (partial.is_dir() and not any(partial.iterdir())):
        return None
    if not (partial / "state.pt").is_file():
        raise ValueError(f"--out {out}: {partial} is not a warm start's checkpoint (no state.pt); {fresh}")
    try:
        state = torch.load(partial / "state.pt", map_location="cpu", weights_only=True)
    except Exception as e:  # a damaged file: name it
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"--out {out}: cannot read {partial / 'state.pt'} ({type(e).__name__}: {first}); "
                         f"{fresh}") from None
    saved = state.get("settings", {})
    differ = [k for k in settings if saved.get(k) != settings[k]]
    if differ:
        k = differ[0]
        raise ValueError(f"--out {out}: {partial} holds an interrupted warm start with other settings ({k}: "
                         f"{saved.get(k)} there, {settings[k]} now); rerun its command to continue it, or "
                         f"{fresh}")
    return state


def save_partial(partial: Path, step: int, model, opt, sched, losses: list, settings: dict) -> None:
    """The adapters, the optimizer and the schedule after `step` steps, written atomically."""
    from engine.lora import adapter_state
    partial.mkdir(parents=True, exist_ok=True)
    tmp = partial / "state.pt.tmp"
    torch.save({"step": step, "settings": settings, "adapters": adapter_state(model), "losses": losses,
                "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}, tmp)
    os.replace(tmp, partial / "state.pt")


def warm_start(model, tok, settings: dict, amp, partial: Path, state: dict | None = None,
               save_every: int = 5) -> list[float]:
    """LoRA adapters on `model` (in place) trained on random agents' replies (`warm_batch`); from `state` (a
    checkpoint, `read_partial`) if given; a checkpoint in `partial` every `save_every` steps. -> the loss of
    every step (mean NLL per reply token). The caller merges the adapters (`save_warm`)."""
    from engine.lora import add_lora
    steps = settings["steps"]
    torch.manual_seed(settings["seed"])  # the adapters' random A
    add_lora(model, settings["lora_rank"], settings["lora_alpha"])
    params = [p for p in model.parameters() if p.requires_grad]  # the adapters, fp32 master weights
    opt = torch.optim.AdamW(params, lr=settings["lr"])
    sched = torch.optim.lr_scheduler.LambdaLR(  # a short warm-up, then cosine down to 10% of the peak
        opt, lambda s: min(1.0, (s + 1) / settings["warmup_steps"]) *
        (0.1 + 0.45 * (1 + math.cos(math.pi * s / steps))))
    start, losses = 0, []
    if state is not None:
        model.load_state_dict(state["adapters"], strict=False)
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        start, losses = state["step"], list(state["losses"])
    saved = start
    kept = frozen_in(model, amp)
    model.train()
    t0 = time.time()
    step = start
    try:
        for step in range(start, steps):
            t1 = time.time()
            segs = warm_batch(tok, settings["seed"], step)
            n = sum(sum(s.loss_mask[1:]) for s in segs)  # the step's reply tokens: one mean over all of them
            opt.zero_grad(set_to_none=True)
            total = 0.0
            for batch in micro_batches(segs):
                loss = reply_nll(model, batch, tok.pad_token_id, amp) / n
                loss.backward()
                total += loss.item()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            losses.append(total)
            if (step + 1) % save_every == 0 and step + 1 < steps:
                save_partial(partial, step + 1, model, opt, sched, losses, settings)
                saved = step + 1
            left = (time.time() - t0) / (step + 1 - start) * (steps - step - 1)
            print(f"step {step + 1}/{steps} | loss {total:.3f} | {time.time() - t1:.1f} s | "
                  f"{left / 60:.1f} min left", flush=True)
    except KeyboardInterrupt:
        where = f"from step {saved} ({partial})" if saved else "afresh (no checkpoint yet)"
        raise KeyboardInterrupt(f"at step {step + 1} of {steps}; the same command continues {where}") \
            from None
    frozen_back(kept)
    model.eval()
    return losses


def save_warm(model, tok, out: Path, max_new_tokens: int) -> None:
    """The warm model as a plain model folder, written atomically: the adapters merged into the fp32 weights,
    the tokenizer with its chat template, and a train_config.json that holds only the reply budget (a
    rollout.ROLLOUT_KEYS key: eval.py and train.py render as for any other policy)."""
    import transformers
    from engine.lora import merge_lora
    merge_lora(model)
    transformers.utils.logging.disable_progress_bar()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".tmp-warm-"))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the model folder from other users
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        rendering = {"max_new_tokens": max_new_tokens}
        (tmp / "train_config.json").write_text(json.dumps(rendering, indent=2) + "\n")
        if out.is_dir():
            out.rmdir()  # an empty folder (main refuses any other)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def warm_rates(path: str, prompts: int, seed: int, max_new_tokens: int) -> dict[str, dict]:
    """Format, valid-action rate and success of the saved warm model on the first `prompts` eval prompts of
    each WARM_MIX env at temperature 0.5 (eval.py's protocol; a quick check, eval.py --prompts 64 measures)
    """
    from engine.models import load_policy
    from envs import EVAL_SEEDS
    from rollout import RolloutConfig, rollout
    model, tok, _ = load_policy(path)
    rates = {}
    for env in WARM_MIX:
        trajs = rollout(env, EVAL_SEEDS[:prompts], list(range(prompts)),
                        RolloutConfig(temperature=0.5, max_new_tokens=max_new_tokens), tokenizer=tok,
                        model=model.eval(), generator=torch.Generator().manual_seed(seed))
        turns = [x for t in trajs for x in t.turns]
        actions = sum(t.num_actions for t in trajs)
        rates[env] = {"format": round(sum(x.parsed for x in turns) / max(1, len(turns)), 3),
                      "valid": round(sum(t.valid_actions for t in trajs) / max(1, actions), 3),
                      "success": round(sum(t.success for t in trajs) / prompts, 3)}
    return rates


@dataclass
class Config:
    out: str = cli.flag(str(PRIOR_DIR),
                        "folder to write the prior into (never overwritten unless --overwrite; with --model "
                        "never, and required)")
    overwrite: bool = cli.flag(False, "replace the prior already in --out (the tiny prior only)")
    steps: int | None = cli.flag(None, f"warm-up steps (default: {TINY_WARMUP['steps']}, a warm start "
                                       f"{WARM['steps']})", lo=1)
    episodes_per_env: int = cli.flag(TINY_WARMUP["episodes_per_env"],
                                     "random-agent episodes per env in the corpus (tiny prior only)", lo=2)
    seed: int = cli.flag(TINY_WARMUP["seed"], "seed of the corpus and the initial weights", lo=0,
                         hi=cli.SEED_MAX)
    format_prompts: int | None = cli.flag(None, "eval prompts per env for the format rate printed at the end "
                                                f"(default: 32, a warm start {WARM['format_prompts']})",
                                          lo=1, hi=256)
    # the warm start: a pretrained instruct LM learns the format and the valid actions
    model: str | None = cli.flag(None, "a pretrained instruct LM (a folder, a .gguf file or a hub id) to "
                                       "warm start instead of building the tiny prior")
    lr: float | None = cli.flag(None, f"warm start: AdamW learning rate (default: {WARM['lr']:g})", gt=0)
    lora_rank: int | None = cli.flag(None, f"warm start: LoRA rank (default: {WARM['lora_rank']})", lo=1)
    lora_alpha: float | None = cli.flag(None, f"warm start: LoRA alpha (default: {WARM['lora_alpha']:g})",
                                        gt=0)
    dtype: str = cli.flag("auto", "warm start: autocast dtype, fp32 master weights; auto = bf16 on CUDA and, "
                                  "for a hub-size model, on CPUs with native bf16 (AVX512-BF16, AMX)",
                          choices=DTYPES)
    threads: int | None = cli.flag(None, "warm start: CPU threads (default: all cores; the tiny prior's size "
                                         "1)", lo=1)
    device: str = cli.flag("auto", "warm start: auto, cpu, cuda or cuda:N")
    save_every: int | None = cli.flag(None, f"warm start: a checkpoint in OUT.partial every this many steps "
                                            f"(default: {WARM['save_every']})", lo=1)


# the tiny prior's flags a warm start refuses, and why
TINY_ONLY = {"overwrite": "a warm start never replaces a folder",
             "episodes_per_env": "a warm start draws fresh episodes every step"}
WARM_ONLY = ("lr", "lora_rank", "lora_alpha", "dtype", "threads", "device", "save_every")


def check_warm(cfg, explicit: set[str]):
    """Every input of a warm start checked and the model loaded, before anything is written.
    -> (out, OUT.partial, model, tokenizer, autocast dtype, settings, checkpoint or None)."""
    from engine.models import choose_dtype, load_policy, model_kind, pick_device
    typed = [k for k in TINY_ONLY if k in explicit]
    why = f"--{typed[0].replace('_', '-')}: only for the tiny prior; {TINY_ONLY[typed[0]]}" if typed else ""
    cli.check([(not typed, why),
               ("out" in explicit, "--out: a warm start needs a new folder to write (e.g. --out "
                                   "models/smollm2-warm)")])
    cli.fill_defaults(cfg, {k: WARM[k] for k in ("steps", "lr", "lora_rank", "lora_alpha", "save_every",
                                                 "format_prompts")})
    out = Path(cfg.out)
    if out.is_dir() and any(out.iterdir()):
        raise ValueError(f"--out {cfg.out}: exists and is not empty; a warm start never replaces a folder: "
                         f"choose another --out or remove it")
    cli.run_folder(cfg.out, "--out", False)  # a file, or a folder that cannot be made or written: refused
    partial = Path(os.path.abspath(out)).with_name(Path(os.path.abspath(out)).name + ".partial")
    device = pick_device(cfg.device)
    model, tok, path = load_policy(cfg.model, "cpu", "--model")
    hidden = getattr(model.config, "hidden_size", None)
    if hidden and cfg.lora_rank > hidden:
        raise ValueError(f"--lora-rank {cfg.lora_rank}: must be <= the model's hidden size {hidden}")
    kind = model_kind(path)
    amp = torch.bfloat16 if choose_dtype(cfg.dtype, device, kind) == "bf16" else None
    cli.fill_defaults(cfg, {"threads": default_threads(kind)})
    settings = warm_settings(cfg, path, amp)
    state = read_partial(partial, settings, cfg.out)
    return out, partial, model.to(device), tok, amp, settings, state


def warm_main(cfg, out, partial, model, tok, amp, settings, state) -> None:
    """python tools/prior.py --model M --out OUT, once its inputs are checked."""
    from engine.models import native_bf16, setup_device
    device = next(model.parameters()).device
    dtype = "bf16" if amp is not None else "fp32"
    setup_device(device, cfg.threads, dtype=dtype)  # threads; the final check's rollouts in the same dtype
    why = "CUDA" if device.type == "cuda" else "native bf16" if native_bf16() else "no native bf16"
    threads = f", {cfg.threads} threads" if device.type == "cpu" else ""
    print(f"warm start: {cfg.model} -> {out} | LoRA r{cfg.lora_rank} alpha {cfg.lora_alpha:g} | AdamW lr "
          f"{cfg.lr:g} | {cfg.steps} steps of {json.dumps(WARM_MIX)} segments | {dtype} (--dtype "
          f"{cfg.dtype}, {why}) on {device.type}{threads} | seed {cfg.seed}", flush=True)
    print(f"resuming from step {state['step']} of {partial}" if state is not None else
          f"a checkpoint every {cfg.save_every} steps in {partial}: after Ctrl-C the same command continues",
          flush=True)
    t0 = time.time()
    losses = warm_start(model, tok, settings, amp, partial, state, cfg.save_every)
    save_warm(model, tok, out, WARM["max_new_tokens"])
    shutil.rmtree(partial, ignore_errors=True)
    trained = time.time() - t0
    rates = warm_rates(str(out), cfg.format_prompts, cfg.seed, WARM["max_new_tokens"])
    print(f"wrote {out} in {time.time() - t0:.0f} s (training {trained:.0f} s); loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}; on {cfg.format_prompts} eval prompts: {json.dumps(rates)}")


def main(argv=None):
    try:
        cfg, explicit = cli.parse(Config, argv, description=__doc__.split("\n")[0])
        cli.check(cli.bounds(cfg))
        if cfg.model is not None:
            warm = check_warm(cfg, explicit)
        else:
            typed = [k for k in WARM_ONLY if k in explicit]
            cli.check([(not typed, f"--{typed[0].replace('_', '-') if typed else ''}: only for a warm start "
                                   f"(with --model)")])
            cli.fill_defaults(cfg, {"steps": TINY_WARMUP["steps"], "format_prompts": 32})
            out = cli.run_folder(cfg.out, "--out", cfg.overwrite, patterns=PRIOR_FILES,
                                 marker=("config.json", "model.safetensors"), what="a prior build")
    except ValueError as e:
        cli.fail(str(e))
    if cfg.model is not None:
        return warm_main(cfg, *warm)
    torch.set_num_threads(1)
    t0 = time.time()
    model, tok = build(warmup=dict(steps=cfg.steps, seed=cfg.seed, episodes_per_env=cfg.episodes_per_env))
    save(model, tok, out)
    rates = {k: round(v, 3) for k, v in format_rates(str(out), cfg.format_prompts).items()}
    print(f"wrote {out} in {time.time() - t0:.0f} s; format rate per env: {json.dumps(rates)}")


if __name__ == "__main__":
    cli.run(main)
