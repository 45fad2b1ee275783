"""Evaluation: the paper's protocol (section 3.3) on any policy, with scripted floors and ceilings.

    python eval.py --env sokoban --policy runs/sokoban-grpo-s0  # a run's final policy
    python eval.py --envs sokoban,sokoban-newvocab,sokoban-large --policy tiny --json out.json
    python eval.py --env frozenlake --policy random  # the floor; --policy expert is the ceiling

256 fixed prompts, one rollout each at temperature 0.5: success with its 95% Wilson interval, actions, valid
and effective actions, format. A saved policy is evaluated with the rollout settings it was trained with.
`--samples K` pools K evals of the same prompts: its interval is for these prompts only.
"""
from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import cli
from envs import ENVS, EVAL_SEEDS
from engine.agents import SCRIPTED, scripted_agent
from engine.report import dump, eval_line, table
from engine.run import start_eval
from rollout import RolloutConfig, Trajectory, rollout


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
                                                "models 400/500)", lo=1)
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


def main(argv=None):
    try:  # every input checked before any work (engine/run.py)
        cfg, _ = cli.parse(Config, argv, description=__doc__.split("\n")[0])
        envs, model, tok, rcfgs, overrides = start_eval(cfg)
    except ValueError as e:
        cli.fail(str(e))

    # ---- one eval per env
    rows = {}
    for env in envs:
        rcfg, t0, trajs, per_sample = rcfgs[env], time.time(), [], []
        for seed in range(cfg.seed, cfg.seed + cfg.samples):  # one eval per sampling seed
            agent = scripted_agent(cfg.policy, seed, rcfg.max_actions_per_turn)  # None: the model
            m, part = evaluate(env, rcfg, model, tok, agent, cfg.prompts, seed, cfg.batch,
                               overrides if env == "webshop" else None)
            trajs += part
            per_sample.append(m["success"])
        m = summarize(trajs, scripted=cfg.policy in SCRIPTED)
        m["seconds"], m["success_per_sample"] = time.time() - t0, per_sample
        rows[env] = m
        print(eval_line(env, m, per_sample), file=sys.stderr)
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
