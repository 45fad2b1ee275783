"""Starting and finishing a training run (train.py), once its config is checked: the processes (one per
GPU under torchrun), the device, the policy, its KL reference, the critic, the memory levers, the optimizers,
a resumed run's state, the run folder; at the end final/. Plumbing around the paper's loop: a reader may skip
it.
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, replace
from pathlib import Path

from engine import distributed as dist
from engine.checkpoint import (open_run, read_checkpoint, read_metrics, restore_models, save_final,
                               saved_settings)
from engine.lora import apply_levers
from engine.models import load_critic, load_model_and_env, pick_device, run_policy, setup_device
from monitor import EchoMonitor
from starpo import make_optimizer


def start_run(cfg, out: Path, describe):
    """-> (device, policy, tok, critic, ref, env overrides, start step, optimizers, monitor, metrics path).
    The KL reference is a frozen copy of the initial policy (with LoRA None: the policy with its adapters off,
    verl's ref_in_actor). A resumed run restores weights, optimizers and monitor from its checkpoint. Rank 0
    prints the run's first line (`describe`) and opens its folder. ValueError on any bad input."""
    start, state, ck = (read_checkpoint(out, "cpu") if cfg.resume else None) or (0, None, None)
    if cfg.steps < start:
        raise ValueError(f"--steps {cfg.steps}: the run already has {start} iterations (give at least that)")
    device = dist.init(pick_device(cfg.device))
    if cfg.groups % dist.world_size():
        k = f" x --online-k {cfg.online_k}" if cfg.online_k > 1 else ""
        raise ValueError(f"--prompts {cfg.prompts}{k}: must be divisible by the number of processes "
                         f"({dist.world_size()}); a prompt group never splits across processes")
    setup_device(device, cfg.threads, cfg.memory_cap)
    policy, tok, path, env_kw = load_model_and_env(cfg, device)
    critic = load_critic(path, device) if cfg.algo == "ppo" else None
    ref = None if cfg.lora_rank else copy.deepcopy(policy).eval().requires_grad_(False)
    if ref is not None and not cfg.kl_coef:  # only measured on eval iterations: kept in CPU memory till then
        ref.to("cpu")
    kept = read_metrics(out / "metrics.jsonl", start) if ck and dist.is_main() else []
    apply_levers([policy, critic.backbone if critic is not None else None], cfg.lora_rank, cfg.lora_alpha,
                 cfg.grad_checkpoint, cfg.seed)
    opts = {"opt": make_optimizer(policy, cfg.lr),
            "critic_opt": make_optimizer(critic, cfg.critic_lr) if critic is not None else None}
    # beyond the paper: GCSL's own AdamW (a supervised step wants ~5x the RL step)
    if cfg.hindsight_imitation:
        opts["imit_opt"] = make_optimizer(policy, cfg.imitation_lr, weight_decay=0.0, betas=(0.9, 0.95))
    monitor = EchoMonitor()
    if ck is not None:
        restore_models(ck, state, policy, critic, cfg.lora_rank > 0, f"--resume {cfg.out}")
        for key, o in opts.items():
            if o is not None:
                o.load_state_dict(state[key])
        monitor = EchoMonitor(**state["monitor"])
    metrics_path = out / "metrics.jsonl"
    if dist.is_main():
        print(describe(cfg, device))
        metrics_path = open_run(out, asdict(cfg), start, kept, cfg.overwrite and not cfg.resume)
        print("config:", json.dumps(asdict(cfg)))
        print(f"resumed from {ck} at iteration {start}" if ck else
              f"no checkpoint in {out} yet: starting the run afresh" if cfg.resume else f"writing {out}")
    return device, policy, tok, critic, ref, env_kw, start, opts, monitor, metrics_path


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
