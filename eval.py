"""Evaluation: the paper's protocol (section 3.3) on any policy, with scripted floors and ceilings.

    python eval.py --env sokoban --policy runs/sokoban-grpo-s0  # a run's final policy
    python eval.py --envs sokoban,sokoban-newvocab,sokoban-large --policy tiny --json out.json
    python eval.py --env frozenlake --policy random  # the floor; --policy expert is the ceiling

256 fixed prompts, one rollout each at temperature 0.5: success with its 95% Wilson interval, actions, valid
and effective actions, format. A saved policy is evaluated with the rollout settings it was trained with.
`--samples K` pools K evals of the same prompts: its interval is for these prompts only.
"""
from __future__ import annotations

import copy
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from engine import cli
from engine.checkpoint import saved_settings
from engine.models import DTYPES, choose_dtype, default_reply_tokens, default_threads
from engine.models import load_policy, model_kind, pick_device, run_policy, setup_device
from engine.report import dump, eval_line, table
from engine.sampler import cache_dtype
from envs import ENVS, EVAL_SEEDS, data_rules
from rollout import ROLLOUT_KEYS, RolloutConfig, Trajectory, expert_thought, rollout

SCRIPTED = ("random", "expert")  # the scripted policies --policy names


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
    samples: int = cli.flag(1, "rollouts per prompt, pooled; pass@k for k = 1, 2, 4, ... (paper: 1)", lo=1)
    device: str = cli.flag("auto", "auto, cpu, cuda or cuda:N")
    threads: int | None = cli.flag(None, "CPU threads (default: tiny 1, hub models all cores)", lo=1)
    dtype: str = cli.flag("auto", "compute dtype: auto (bf16 on CUDA, and on CPUs with native bf16 for hub "
                                  "models), fp32, bf16", choices=DTYPES)
    webshop_data: str | None = cli.flag(None, "folder with the original WebShop files")
    json: str | None = cli.flag(None, "write the numbers to this new JSON file")
    dump: int = cli.flag(0, "print this many trajectories as text", lo=0)


# ---- scripted agents: the floor and the ceiling of every eval

# An agent is `act(env, actions_left, cfg) -> (actions, thought)`; rollout.py renders it as a reply, as it
# renders a policy's. A turn's actions are planned on a copy of the env, each valid where the previous ones
# lead (WebShop's clicks change with the page), and the expert's plan meets the same slips.

def available_actions(env) -> list[str]:
    fn = getattr(env, "available_actions", None)
    return fn() if callable(fn) else list(env.actions)


def plan_on_copy(env, k: int, choose) -> list[str]:
    """Up to k actions, each `choose(sim)` where the previous lead on a copy of the env, until it ends."""
    sim, plan = copy.deepcopy(env), []
    for _ in range(k):
        plan.append(choose(sim))
        _, _, done, _ = sim.step(plan[-1])
        if done:
            break
    return plan


def random_agent(rng: random.Random):
    """1..min(max per turn, actions left) actions, each uniform among those valid where the previous ones
    lead, and a truthful fixed thought: the floor of every eval."""
    def act(env, actions_left: int, cfg: RolloutConfig) -> tuple[list[str], str]:
        k = rng.randint(1, max(1, min(cfg.max_actions_per_turn, actions_left)))
        plan = plan_on_copy(env, k, lambda sim: rng.choice(available_actions(sim)))
        return plan, "I pick my moves at random."
    return act


def expert_agent(actions_per_turn: int = 1):
    """The env's optimal policy (the SFT baseline's data, App. G), several actions a turn planned on a
    copy of the env, its thought truthful."""
    def act(env, actions_left: int, cfg: RolloutConfig) -> tuple[list[str], str]:
        k = max(1, min(actions_per_turn, cfg.max_actions_per_turn, actions_left))
        plan = plan_on_copy(env, k, lambda sim: sim.expert_action())
        note = env.expert_note() if hasattr(env, "expert_note") else ""
        return plan, expert_thought(note, plan)
    return act


def scripted_agent(policy: str, seed: int, actions_per_turn: int):
    """--policy random (seeded) or expert; None for a model."""
    if policy == "random":
        return random_agent(random.Random(seed))
    if policy == "expert":
        return expert_agent(actions_per_turn)
    return None


# ---- the protocol

def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The 95% Wilson interval of k/n (sound at 0 and 1)."""
    if n == 0:
        return 0.0, 1.0
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def pass_at_k(solved: list[int], n: int, k: int) -> float:
    """The unbiased pass@k (Chen et al. 2021, as RAGEN's eval reports it): a prompt solved by c of its n
    samples scores 1 - C(n - c, k) / C(n, k), the chance that k of them drawn without replacement hold a
    success; averaged over the prompts. pass@1 is the pooled success rate."""
    return sum(1.0 - math.comb(n - c, k) / math.comb(n, k) for c in solved) / len(solved)


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


def rollout_metrics(trajs: list[Trajectory]) -> dict:
    """train.py's rollout/ metrics of an iteration's trajectories: `summarize`'s (the reward as its mean,
    no interval) and the reward's std over all of them."""
    m = {}
    for k, v in summarize(trajs).items():
        if k not in ("success_lo", "success_hi", "episodes"):
            m["rollout/reward_mean" if k == "reward" else f"rollout/{k}"] = v
    m["rollout/reward_std"] = torch.tensor([t.reward for t in trajs]).std().item()
    return m


# bytes: the most KV cache one eval batch may be estimated to fill on a CPU: 12 GiB, or a quarter of this
# machine's memory if less (at 12 GiB on a 24 GiB machine, 128 episodes at 400-token replies beside two
# training runs grew the process to 17.8 GB and were killed: the cache is not all an eval holds)
MEMORY = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 16 * 2 ** 30
EVAL_KV_BUDGET = min(12 * 2 ** 30, MEMORY // 4)


def eval_batch(device, model=None, rcfg: RolloutConfig | None = None) -> int:
    """Episodes rolled out at once. CUDA: 128 (their KV cache fits beside training). A CPU: 256, halved
    while the cache they could grow to passes EVAL_KV_BUDGET: a 256-token header, then per turn the reply
    cap and 128 tokens of feedback, x1.5 for the engine's room to grow (an upper bound: replies stop early).
    256 Sokoban episodes of SmolLM2 at 400-token replies, at once, grew the process to 13 GB and were killed
    (24 GiB); so did 128 beside two training runs."""
    if device.type == "cuda":
        return 128
    rows = 256
    if model is None or rcfg is None or not hasattr(model, "config"):
        return rows
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dtype = cache_dtype(model)  # the engine's rule
    per_column = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * dtype.itemsize  # K and V
    columns = 1.5 * (256 + rcfg.max_turns * (rcfg.max_new_tokens + 128))
    while rows > 16 and rows * columns * per_column > EVAL_KV_BUDGET:
        rows //= 2
    return rows


def evaluate(env: str, rcfg: RolloutConfig, model=None, tokenizer=None, agent=None, prompts: int = 256,
             seed: int = 0, batch: int | None = None, env_overrides: dict | None = None):
    """The first `prompts` (1..256) eval seeds, one rollout each, in batches; -> (metrics, trajectories)."""
    seeds = EVAL_SEEDS[:prompts]
    device = next(model.parameters()).device if model is not None else torch.device("cpu")
    batch = batch or eval_batch(device, model, rcfg)
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
    """The rollout settings for `env`: those saved beside the policy (train_config.json), the flags typed
    (`cfg`) on top, the model's reply budget (engine/models.py) when neither gives one."""
    values = saved_settings(policy_path, ROLLOUT_KEYS, "--policy")
    for k in ROLLOUT_KEYS:
        if getattr(cfg, k, None) is not None:
            values[k] = getattr(cfg, k)
    values.setdefault("max_new_tokens", default_reply_tokens(model_kind(policy_path or "tiny"), env))
    return RolloutConfig(temperature=cfg.temperature, **values)


def settings(rcfg: RolloutConfig) -> dict:  # what a rollout renders and samples (no speed-only switch)
    return {k: v for k, v in asdict(rcfg).items() if k in ROLLOUT_KEYS or k == "temperature"}


def check_envs(cfg: Config) -> list[str]:
    """--env or --envs -> the envs to evaluate, every rule of the flags checked."""
    envs = [cfg.env]
    if cfg.envs is not None:
        envs = [e.strip() for e in cfg.envs.split(",")]
    allowed = ", ".join(sorted(ENVS))
    unknown = [e for e in envs if e not in ENVS]
    cli.check(cli.bounds(cfg) + [
        (any(envs), f"--envs {cfg.envs!r}: names no env; allowed: {allowed}"),
        (all(envs), f"--envs {cfg.envs!r}: an empty name between commas; allowed: {allowed}"),
        (not unknown, f"--envs: unknown env {', '.join(map(repr, unknown))}; allowed: {allowed}"),
        (cfg.seed + cfg.samples - 1 <= cli.SEED_MAX,
         f"--samples {cfg.samples}: with --seed {cfg.seed} the last seed exceeds {cli.SEED_MAX}"),
        (cfg.samples == 1 or cfg.policy != "expert",
         f"--samples {cfg.samples}: the expert does not sample, every sample would be the first; use 1"),
        (cfg.samples == 1 or cfg.temperature > 0 or cfg.policy in SCRIPTED,
         f"--samples {cfg.samples}: --temperature 0 decodes greedily, every sample would repeat the "
         f"first; use 1 or a temperature above 0"),
    ] + data_rules(cfg.webshop_data, envs))
    return envs


def main(argv=None):
    # ---- 1. the config: every input checked before any work
    with cli.one_line_errors():
        cfg, _ = cli.parse(Config, argv, description=__doc__.split("\n")[0])
        envs = check_envs(cfg)
        if cfg.json:
            cli.writable_file(cfg.json, "--json", new=True)

        # ---- 2. the setup: device, policy (none for a scripted agent), each env's rollout settings
        device = pick_device(cfg.device)
        name = cfg.policy if cfg.policy in SCRIPTED else run_policy(cfg.policy, "--policy")
        kind = "tiny" if cfg.policy in SCRIPTED else model_kind(name)
        dtype = choose_dtype(cfg.dtype, device, kind)
        threads = cfg.threads if cfg.threads is not None else default_threads(kind)
        setup_device(device, threads, dtype=dtype)
        model = tok = path = None
        if cfg.policy not in SCRIPTED:
            model, tok, path = load_policy(name, device, "--policy")
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

    # ---- 3. one eval per env
    rows = {}
    for env in envs:
        rcfg, t0, trajs, per_sample = rcfgs[env], time.time(), [], []
        solved = [0] * cfg.prompts  # each prompt's successes over the samples
        for seed in range(cfg.seed, cfg.seed + cfg.samples):  # one eval per sampling seed
            agent = scripted_agent(cfg.policy, seed, rcfg.max_actions_per_turn)  # None: the model
            m, part = evaluate(env, rcfg, model, tok, agent, cfg.prompts, seed, cfg.batch,
                               overrides if env == "webshop" else None)
            trajs += part
            per_sample.append(m["success"])
            for i, t in enumerate(part):
                solved[i] += t.success
        m = summarize(trajs, scripted=cfg.policy in SCRIPTED)
        m["seconds"], m["success_per_sample"] = time.time() - t0, per_sample
        if cfg.samples > 1:  # k = 1 and every power of two up to the samples
            ks = [2 ** j for j in range(cfg.samples.bit_length()) if 2 ** j <= cfg.samples]
            m["pass_at_k"] = {str(k): pass_at_k(solved, cfg.samples, k) for k in ks}
        rows[env] = m
        print(eval_line(env, m, per_sample), file=sys.stderr)
        for t in trajs[:cfg.dump]:
            print(dump(t, tok), file=sys.stderr)
    print(f"policy: {cfg.policy}, {cfg.prompts} prompts x {cfg.samples} sample(s), temperature "
          f"{cfg.temperature}, rollout: {settings(rcfgs[envs[0]])}")
    print(table(rows))
    if cfg.json:
        rollouts = {env: settings(r) for env, r in rcfgs.items()}
        Path(cfg.json).write_text(json.dumps({"policy": cfg.policy, "results": rows, "rollout": rollouts},
                                             indent=2))
    return rows


if __name__ == "__main__":
    cli.run(main)
