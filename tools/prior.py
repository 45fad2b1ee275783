"""The tiny prior: how the policy that `--model tiny` loads from `prior/` was built, and how to rebuild it.

    python tools/prior.py --out prior-rebuilt        # ~3 min on one CPU thread; prints each env's format rate
    python eval.py --env bandit --policy prior-rebuilt

The paper starts from Qwen2.5-0.5B-Instruct (section 3.2): a model that knows the answer format but not the
tasks. The tiny prior plays that part on a CPU: a real Qwen2-architecture `transformers` model (~1M
parameters) with a word-level tokenizer built from the environments' texts (each tag with its leading space
one token), warmed up on random agents' conversations rendered as rollout.py renders them (both think modes,
whole and windowed; the loss on the replies and, as a pre-trained LM has modelled text, on the boards and
feedback). It is built once and shipped in `prior/` (~4 MB): a build is deterministic on one machine, but
float rounding differs between CPUs (two machines' builds differed by 0.18 in Bandit success), so every
machine starts from the same weights. `ensure_tiny` builds small variants for the tests and for new envs.
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

import torch
import torch.nn as nn

import sys

# the repository root, for python tools/prior.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import cli  # noqa: E402
from engine.logprobs import pad_segments  # noqa: E402
from engine.models import PRIOR_DIR  # noqa: E402

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



def tiny_envs() -> list[str]:
    from envs import ENVS
    return sorted(ENVS)


def tiny_corpus(envs: list[str], episodes: int, seed: int):
    """Random-agent conversations (text only) for every env, think mode and history window."""
    from engine.agents import random_agent
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
    from engine.agents import random_agent
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


@dataclass
class Config:
    out: str = cli.flag(str(PRIOR_DIR),
                        "folder to write the prior into (never overwritten unless --overwrite)")
    overwrite: bool = cli.flag(False, "replace the prior already in --out")
    steps: int = cli.flag(TINY_WARMUP["steps"], "warm-up steps", lo=1)
    episodes_per_env: int = cli.flag(TINY_WARMUP["episodes_per_env"],
                                     "random-agent episodes per env in the corpus", lo=2)
    seed: int = cli.flag(TINY_WARMUP["seed"], "seed of the corpus and the initial weights", lo=0,
                         hi=cli.SEED_MAX)
    format_prompts: int = cli.flag(32, "eval prompts per env for the format rate printed at the end", lo=1,
                                   hi=256)


def main(argv=None):
    try:
        cfg, _ = cli.parse(Config, argv, description=__doc__.split("\n")[0])
        cli.check(cli.bounds(cfg))
        out = cli.run_folder(cfg.out, "--out", cfg.overwrite, patterns=PRIOR_FILES,
                             marker=("config.json", "model.safetensors"), what="a prior build")
    except ValueError as e:
        cli.fail(str(e))
    torch.set_num_threads(1)
    t0 = time.time()
    model, tok = build(warmup=dict(steps=cfg.steps, seed=cfg.seed, episodes_per_env=cfg.episodes_per_env))
    save(model, tok, out)
    rates = {k: round(v, 3) for k, v in format_rates(str(out), cfg.format_prompts).items()}
    print(f"wrote {out} in {time.time() - t0:.0f} s; format rate per env: {json.dumps(rates)}")


if __name__ == "__main__":
    cli.run(main)
