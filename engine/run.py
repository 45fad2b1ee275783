"""Around a training run (train.py): a --model that a run trained lends its prompt rendering, a resumed run
that is already complete, a loop stopped early (a diverged policy, Ctrl-C), and the end of a run (the
replicas checked identical under torchrun, final/ written, the process group closed). Plumbing around the
paper's loop: a reader may skip it.
"""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from engine import cli
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


def run_complete(out: Path, start: int, steps: int, ck) -> bool:
    """A resumed run that already reached --steps and wrote final/: say so (and how to go on); the caller
    then does nothing and writes nothing."""
    if ck is None or start != steps or not (out / "final").is_dir():
        return False
    print(f"{out}: the run is complete ({start} iterations); evaluate it with python eval.py --policy {out}, "
          f"or continue it with --resume {out} --steps N (N > {start})")
    return True


def stopped(e: BaseException, it: int, saved_at: int, out: Path, lr_flag: str):
    """The loop ended early at iteration `it`, after the checkpoint of `saved_at` (0: none). A diverged policy
    (FloatingPointError) exits with code 1 and says where the metrics so far and the last checkpoint are;
    Ctrl-C says how to continue (cli.run prints it and exits 130): nothing saved is lost."""
    if isinstance(e, FloatingPointError):
        last = f"{out}/ckpt-{saved_at:06d}" if saved_at else "none"
        cli.fail(f"iteration {it}: {e} ({lr_flag} is too high?); the metrics so far are in "
                 f"{out / 'metrics.jsonl'}, the last checkpoint: {last}", code=1)
    where = f"iteration {saved_at}" if saved_at else "none yet"
    raise KeyboardInterrupt(f"at iteration {it} (last checkpoint: {where}); continue with: python train.py "
                            f"--resume {out}") from None
