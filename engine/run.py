"""Around a training run (train.py): a --model that a run trained lends its prompt rendering, and the end
of a run (the replicas checked identical under torchrun, final/ written, the process group closed). Plumbing
around the paper's loop: a reader may skip it.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from engine import distributed as dist
from engine.checkpoint import save_final, saved_settings
from engine.models import run_policy


def inherit_rendering(cfg, explicit: set[str], keys):
    """A --model saved by train.py or sft_baseline.py (a run folder: its policy) is trained on prompts
    rendered as it was trained (the settings `keys` of its train_config.json), unless a flag says
    otherwise."""
    cfg = replace(cfg, model=run_policy(cfg.model, "--model"))
    inherited = {k: v for k, v in saved_settings(cfg.model, keys, "--model").items() if k not in explicit}
    if inherited and dist.is_main():
        print(f"rollout settings of {cfg.model}: {json.dumps(inherited)}")
    return replace(cfg, **inherited)


def finish_run(cfg, out: Path, policy, tok, critic) -> Path:
    """After the loop: the replicas checked identical (torchrun), final/ written, the process group closed."""
    if dist.world_size() > 1:  # a DDP mistake shows as replicas drifting apart: check once, bitwise
        digest = dist.assert_in_sync(policy, critic)
        if dist.is_main():
            print(f"weights identical on all {dist.world_size()} processes (sha256 {digest})")
    if dist.is_main():
        save_final(out, policy, tok, cfg)
        print(f"final policy: {out / 'final'}")
    dist.close()
    return out
