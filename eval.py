"""Evaluation: the paper's protocol (section 3.3) on any policy, with scripted floors and ceilings.

    python eval.py --env sokoban --policy runs/sokoban-grpo-s0          # a run's final policy
    python eval.py --envs sokoban,sokoban-newvocab,sokoban-large --policy tiny --json out.json
    python eval.py --env frozenlake --policy random     # the floor; --policy expert is the ceiling

256 fixed prompts, one rollout each at temperature 0.5: success with its 95% Wilson interval, actions, valid
and effective actions, format. A saved policy is evaluated with the rollout settings it was trained with.
`--samples K` pools K evals of the same prompts: its interval is for these prompts only.
"""
from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from engine import cli
from engine.checkpoint import saved_settings
from envs import ENVS, EVAL_SEEDS
from engine.agents import expert_agent, random_agent
from rollout import ROLLOUT_KEYS, RolloutConfig, Trajectory, default_reply_tokens, dump, rollout

SCRIPTED = ("random", "expert")


@dataclass
class Config:
    env: str = cli.flag("sokoban", "environment to evaluate on", choices=ENVS)
    envs: str | None = cli.flag(None, "comma-separated envs (instead of --env): one markdown table")
    policy: str = cli.flag("tiny", "a run, a model folder, a .gguf file, a hub id, tiny, random or expert")
    prompts: int = cli.flag(256, "fixed eval prompts used", lo=1, hi=256)
    temperature: float = cli.flag(0.5, "sampling temperature (paper: 0.5); 0 = greedy", lo=0)
    max_turns: int | None = cli.flag(None, "turns per episode (default: as trained, else 5)", lo=1)
    max_actions_per_turn: int | None = cli.flag(None, "actions per turn (default: as trained, else 5)", lo=1)
    max_actions: int | None = cli.flag(None, "actions per episode (default: as trained, else 10)", lo=1)
    think: bool | None = cli.flag(None, "<think> before <answer> (default: as trained, else on)")
    context_turns: int | None = cli.flag(None, "history in turns, 0 = all (default: as trained)", lo=0)
    max_new_tokens: int | None = cli.flag(None, "tokens per reply (default: as trained, else tiny 100, hub "
                                                "models 400, 500 on bandit)", lo=1)
    batch: int | None = cli.flag(None, "episodes decoded together (default: 256, 128 on CUDA)", lo=1)
    seed: int = cli.flag(0, "sampling seed", lo=0, hi=cli.SEED_MAX)
    samples: int = cli.flag(1, "rollouts per prompt, pooled (paper: 1)", lo=1)
    device: str = cli.flag("auto", "auto, cpu, cuda or cuda:N")
    threads: int = cli.flag(1, "CPU threads", lo=1)
    webshop_data: str | None = cli.flag(None, "folder with the original WebShop files")
    json: str | None = cli.flag(None, "write the numbers to this new JSON file")
    dump: int = cli.flag(0, "print this many trajectories as text", lo=0)


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson interval of k/n (sound at 0 and 1)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(trajs: list[Trajectory], scripted: bool = False) -> dict:
    """Success with its interval, actions, valid and effective action rates, format, tokens per turn."""
    n = len(trajs)
    k = sum(t.success for t in trajs)
    lo, hi = wilson(k, n)
    acts = sum(t.num_actions for t in trajs)
    turns = [x for t in trajs for x in t.turns]
    return {
        "success": k / n, "success_lo": lo, "success_hi": hi,
        "reward": sum(t.reward for t in trajs) / n,
        "num_actions": acts / n,
        "valid_action": sum(t.valid_actions for t in trajs) / max(1, acts),
        "effective_action": sum(t.effective_actions for t in trajs) / max(1, acts),
        "format": sum(x.parsed for x in turns) / max(1, len(turns)),
        "turns": len(turns) / n,
        "truncated": sum(t.truncated for t in trajs) / n,
        "response_length": None if scripted else sum(x.response_tokens for x in turns) / max(1, len(turns)),
        "episodes": n,
    }


def eval_batch(device) -> int:  # CUDA: the KV cache of 128 rows fits beside training
    return 128 if device.type == "cuda" else 256


def evaluate(env: str, rcfg: RolloutConfig, model=None, tokenizer=None, agent=None, prompts: int = 256,
             seed: int = 0, batch: int | None = None, env_overrides: dict | None = None):
    """The first `prompts` (1..256) eval seeds, one rollout each, in batches; -> (metrics, trajectories)."""
    seeds = EVAL_SEEDS[:prompts]
    device = next(model.parameters()).device if model is not None else torch.device("cpu")
    batch = batch or eval_batch(device)
    gen = torch.Generator(device=device).manual_seed(seed)  # eval never moves training's RNG
    trajs: list[Trajectory] = []
    was_training = model.training if model is not None else False
    if model is not None:
        model.eval()
    for i in range(0, len(seeds), batch):
        part = seeds[i:i + batch]
        trajs += rollout(env, part, list(range(i, i + len(part))), rcfg, tokenizer=tokenizer, model=model,
                         agent=agent, generator=gen, env_overrides=env_overrides)
    if model is not None and was_training:
        model.train()
    return summarize(trajs, scripted=agent is not None), trajs


def eval_metrics(env: str, rcfg: RolloutConfig, model, tok, prompts: int, seed: int, env_overrides: dict,
                 path: Path | None = None, dumps: int = 0) -> dict:
    """A training run's eval: eval/ metrics, time/eval; the first `dumps` episodes as text in `path`."""
    t0 = time.time()
    m, trajs = evaluate(env, rcfg, model, tok, prompts=prompts, seed=seed, env_overrides=env_overrides)
    if path is not None:
        path.write_text("".join(dump(t, tok) + "\n" for t in trajs[:dumps]))
    return {**{f"eval/{k}": v for k, v in m.items() if k != "episodes"}, "time/eval": time.time() - t0}


def rollout_config_for(policy_path: str | None, cfg: Config, env: str) -> RolloutConfig:
    """The rollout settings saved beside the policy, the flags typed here on top."""
    from engine.models import model_kind
    values = saved_settings(policy_path, ROLLOUT_KEYS, "--policy")
    values.update({k: getattr(cfg, k) for k in ROLLOUT_KEYS if getattr(cfg, k, None) is not None})
    values.setdefault("max_new_tokens", default_reply_tokens(model_kind(policy_path or "tiny"), env))
    return RolloutConfig(temperature=cfg.temperature, **values)


def table(rows: dict[str, dict]) -> str:
    head = "| env | success (95% CI) | reward | actions | valid | effective | format | resp. tokens |"
    out = [head, "|" + "---|" * 8]
    for env, m in rows.items():
        rl = "-" if m["response_length"] is None else f"{m['response_length']:.1f}"
        out.append(f"| {env} | {m['success']:.3f} ({m['success_lo']:.3f}-{m['success_hi']:.3f}) | "
                   f"{m['reward']:.3f} | {m['num_actions']:.2f} | {m['valid_action']:.3f} | "
                   f"{m['effective_action']:.3f} | {m['format']:.3f} | {rl} |")
    return "\n".join(out)


def main(argv=None):
    # ---- config, checked before any work
    try:
        cfg, _ = cli.parse(Config, argv, description=__doc__.split("\n")[0])
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
        from engine.models import load_policy, pick_device, run_policy, setup_device
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
    except ValueError as e:
        cli.fail(str(e))

    # ---- one eval per env
    rows = {}
    for env in envs:
        rcfg, t0, trajs, per_sample = rcfgs[env], time.time(), [], []
        for seed in range(cfg.seed, cfg.seed + cfg.samples):  # one eval per sampling seed
            agent = None
            if cfg.policy == "random":
                agent = random_agent(random.Random(seed))
            elif cfg.policy == "expert":
                agent = expert_agent(rcfg.max_actions_per_turn)
            m, part = evaluate(env, rcfg, model, tok, agent, cfg.prompts, seed, cfg.batch,
                               overrides if env == "webshop" else None)
            trajs += part
            per_sample.append(m["success"])
        m = summarize(trajs, scripted=cfg.policy in SCRIPTED)
        m["seconds"], m["success_per_sample"] = time.time() - t0, per_sample
        rows[env] = m
        each = f" (per sample: {' '.join(f'{x:.3f}' for x in per_sample)})" if cfg.samples > 1 else ""
        print(f"{env}: success {m['success']:.3f} [{m['success_lo']:.3f}, {m['success_hi']:.3f}]{each} "
              f"actions {m['num_actions']:.2f} valid {m['valid_action']:.3f} effective "
              f"{m['effective_action']:.3f} format {m['format']:.3f} ({m['seconds']:.0f}s)", file=sys.stderr)
        for t in trajs[:cfg.dump]:
            print(dump(t, tok), file=sys.stderr)
    print(f"policy: {cfg.policy}, {cfg.prompts} prompts x {cfg.samples} sample(s), temperature "
          f"{cfg.temperature}, rollout: {asdict(rcfgs[envs[0]])}")
    print(table(rows))
    if cfg.json:
        rollouts = {env: asdict(r) for env, r in rcfgs.items()}
        Path(cfg.json).write_text(json.dumps({"policy": cfg.policy, "results": rows, "rollout": rollouts},
                                             indent=2))
    return rows


if __name__ == "__main__":
    cli.run(main)
