"""Starting and finishing a training run (train.py), once its config is checked: the processes (one per
GPU under torchrun), the device, the policy, its KL reference, the critic, the memory levers, the optimizers,
a resumed run's state, the run folder; at the end final/. Also sft_baseline.py's start, eval.py's (its
checks, the policy, the rollout settings saved beside it) and train.py's --model settings. Plumbing around
the paper's loop: a reader may skip it.
"""
from __future__ import annotations

import copy
import json
from dataclasses import asdict, replace
from pathlib import Path

import torch

from engine import cli, distributed as dist
from engine.agents import SCRIPTED
from engine.checkpoint import (open_run, read_checkpoint, read_metrics, restore_models, save_final,
                               saved_settings)
from engine.lora import add_lora, apply_levers
from engine.models import (default_reply_tokens, load_critic, load_model_and_env, load_policy, model_kind,
                           pick_device, run_policy, setup_device)
from envs import ENVS
from monitor import EchoMonitor
from rollout import ROLLOUT_KEYS, RolloutConfig


def make_optimizer(module: torch.nn.Module, lr: float, weight_decay: float = 0.01,
                   betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (verl's weight decay 0.01)."""
    return torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr,
                             weight_decay=weight_decay, betas=betas)


def start_sft(cfg, out: Path):
    """sft_baseline.py's start -> (device, policy, tok, env overrides, optimizer, start step, a resumed
    run's checkpoint state and path, its metrics kept). The adapters' init is seeded. ValueError on bad
    input."""
    start, state, ck = (read_checkpoint(out, "cpu") if cfg.resume else None) or (0, None, None)
    kept = read_metrics(out / "metrics.jsonl", start) if ck else []
    device = pick_device(cfg.device)
    setup_device(device, cfg.threads)
    policy, tok, _, env_kw = load_model_and_env(cfg, device)
    if cfg.lora_rank > 0:
        torch.manual_seed(cfg.seed)
        print(f"LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha:g} on "
              f"{len(add_lora(policy, cfg.lora_rank, cfg.lora_alpha))} linear layers")
    opt = make_optimizer(policy, cfg.lr, betas=(0.9, cfg.adam_beta2))
    return device, policy, tok, env_kw, opt, start, state, ck, kept


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


def rollout_config_for(policy_path: str | None, cfg, env: str) -> RolloutConfig:
    """eval.py's rollout settings for `env`: those saved beside the policy, the flags typed (`cfg`) on top."""
    values = saved_settings(policy_path, ROLLOUT_KEYS, "--policy")
    values.update({k: getattr(cfg, k) for k in ROLLOUT_KEYS if getattr(cfg, k, None) is not None})
    values.setdefault("max_new_tokens", default_reply_tokens(model_kind(policy_path or "tiny"), env))
    return RolloutConfig(temperature=cfg.temperature, **values)


def start_eval(cfg):
    """eval.py's inputs, every one checked before any work: the envs, the device, the policy (None for a
    scripted one), the rollout settings per env (`rollout_config_for`), the env overrides.
    -> (envs, model, tok, rollout settings per env, overrides). ValueError on any bad input."""
    envs = [cfg.env] if cfg.envs is None else [e.strip() for e in cfg.envs.split(",") if e.strip()]
    unknown = [e for e in envs if e not in ENVS]
    cli.check(cli.bounds(cfg) + [
        (bool(envs), f"--envs {cfg.envs!r}: names no env; allowed: {', '.join(sorted(ENVS))}"),
        (not unknown, f"--envs: unknown env {', '.join(map(repr, unknown))}; allowed: "
                      f"{', '.join(sorted(ENVS))}"),
        (cfg.seed + cfg.samples - 1 <= cli.SEED_MAX,
         f"--samples {cfg.samples}: with --seed {cfg.seed} the last seed exceeds {cli.SEED_MAX}"),
        (cfg.samples == 1 or cfg.policy != "expert",
         f"--samples {cfg.samples}: the expert does not sample, every sample would be the first; use 1"),
        (cfg.samples == 1 or cfg.temperature > 0 or cfg.policy in SCRIPTED,
         f"--samples {cfg.samples}: --temperature 0 decodes greedily, every sample would repeat the "
         f"first; use 1 or a temperature above 0"),
        (not cfg.webshop_data or "webshop" in envs,
         f"--webshop-data {cfg.webshop_data}: only for the webshop env (evaluating: {', '.join(envs)})"),
    ])
    if cfg.json:
        cli.writable_file(cfg.json, "--json", new=True)
    device = pick_device(cfg.device)
    setup_device(device, cfg.threads)
    model = tok = path = None
    if cfg.policy not in SCRIPTED:
        model, tok, path = load_policy(run_policy(cfg.policy, "--policy"), device, flag_name="--policy")
    rcfgs = {env: rollout_config_for(path, cfg, env) for env in envs}
    for rcfg in rcfgs.values():  # saved values meet the flags' bounds too
        saved = {k: getattr(rcfg, k) for k in ROLLOUT_KEYS if hasattr(cfg, k)}
        cli.check(cli.bounds(replace(cfg, **saved)))
    positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if positions is not None and rcfgs[envs[0]].max_new_tokens >= positions:
        raise ValueError(f"--max-new-tokens {rcfgs[envs[0]].max_new_tokens}: the model reads at most "
                         f"{positions} positions")
    overrides = {"data_dir": cfg.webshop_data} if cfg.webshop_data else {}
    if "webshop" in envs:
        ENVS["webshop"](**overrides)  # a bad data folder fails now
    return envs, model, tok, rcfgs, overrides


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
