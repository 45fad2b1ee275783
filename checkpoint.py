"""Checkpoints of a training run: written atomically, read back with one clear line when damaged.

An interrupted run loses nothing saved: `ckpt-STEP/` is written completely into a temp folder and renamed, and
`latest` is repointed atomically, so a run stopped at any moment resumes from its last whole checkpoint
(`python train.py --resume RUN`) and reproduces the uninterrupted run (train.py deviation 1). The paper has no
section on checkpoints; its runs (RAGEN on verl) save the actor, critic and optimizer states the same way.

Deviations from the paper / RAGEN (deliberate):
1. The two newest checkpoints are kept, older ones deleted (verl keeps every one unless told otherwise).
2. The generators' states are not saved: every draw of iteration i derives from (seed, i) (train.py deviation 1).
3. A LoRA run (`--lora-rank`) saves its policy merged (a plain model for eval.py) and its adapters in state.pt,
   from which --resume continues exactly.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path

import torch

from lora import adapter_state, plain_state_dict


def read_checkpoint(out: Path, device):
    """-> (step, state dict, checkpoint folder) of the run's latest checkpoint, or None if it has none yet.
    A checkpoint that cannot be read is a ValueError naming its file."""
    if not (out / "latest").is_file():
        return None
    ck = out / (out / "latest").read_text().strip()
    try:
        state = torch.load(ck / "state.pt", map_location=device, weights_only=False)
        step = int(state["step"])
    except Exception as e:  # a damaged file is the user's input here: name it
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"--resume {out}: cannot read {ck / 'state.pt'} ({type(e).__name__}: {first})") from None
    return step, state, ck


def read_metrics(path: Path, upto: int) -> list[str]:
    """The metrics lines of iterations 1..upto (a resumed run continues after them)."""
    if not path.is_file():
        raise ValueError(f"--resume {path.parent}: {path} is missing; its checkpoint is at iteration {upto}, but "
                         f"resuming would leave no record of the iterations before it")
    kept = []
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if text.strip():
            try:
                step = json.loads(text)["step"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--resume {path.parent}: {path} line {n} is not a metrics line") from None
            if step <= upto:
                kept.append(text)
    return kept


def save_checkpoint(out: Path, step: int, policy, tok, critic, opt, critic_opt, imit_opt, monitor, save_every: int):
    """Write ckpt-STEP/ completely, then point `latest` at it atomically (temp file + rename)."""
    final = out / f"ckpt-{step:06d}"
    tmp = out / f".tmp-ckpt-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp / "policy", state_dict=plain_state_dict(policy))  # LoRA merged: a plain model
    tok.save_pretrained(tmp / "policy")
    state = {"step": step, "opt": opt.state_dict(), "monitor": asdict(monitor), "lora": adapter_state(policy)}
    if imit_opt is not None:
        state["imit_opt"] = imit_opt.state_dict()
    if critic is not None:
        critic.save_pretrained(str(tmp / "critic"))
        state["critic_opt"] = critic_opt.state_dict()
        state["critic_lora"] = adapter_state(critic)
    torch.save(state, tmp / "state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = out / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, out / "latest")
    for old in out.glob("ckpt-*"):  # keep the newest two
        if old.name not in (final.name, f"ckpt-{step - save_every:06d}"):
            shutil.rmtree(old, ignore_errors=True)


def save_final(out: Path, policy, tok, cfg) -> None:
    """A plain save_pretrained folder (+ train_config.json so eval.py renders prompts the same way)."""
    final = out / "final"
    policy.save_pretrained(final, state_dict=plain_state_dict(policy))
    tok.save_pretrained(final)
    (final / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))
