"""Scripted agents: a random one (every eval's floor) and the environment's expert (its ceiling, and the SFT
baseline's data), both replying through rollout.py's loop like a policy. Not the paper's method.

An agent is `act(env, actions_left, cfg) -> (actions, thought)`; rollout.py renders it as a reply
(`scripted_reply`). Several actions of a turn are planned on a copy of the env, so that each is valid where
the previous ones lead (WebShop's clicks change with the page) and the expert's plan meets the same slips.
"""
from __future__ import annotations

import copy
import random

from rollout import RolloutConfig, expert_thought

SCRIPTED = ("random", "expert")  # the scripted policies eval.py's --policy names


def scripted_agent(policy: str, seed: int, actions_per_turn: int):
    """eval.py's --policy random (seeded) or expert; None for a model."""
    if policy == "random":
        return random_agent(random.Random(seed))
    return expert_agent(actions_per_turn) if policy == "expert" else None


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
    """1..min(max per turn, actions left) actions, each uniform among those valid where the previous ones lead
    (WebShop's clicks change with the page), and a truthful fixed thought: the floor of every eval."""
    def act(env, actions_left: int, cfg: RolloutConfig) -> tuple[list[str], str]:
        k = rng.randint(1, max(1, min(cfg.max_actions_per_turn, actions_left)))
        plan = plan_on_copy(env, k, lambda sim: rng.choice(available_actions(sim)))
        return plan, "I pick my moves at random."
    return act


def expert_agent(actions_per_turn: int = 1):
    """The env's optimal policy, several actions a turn planned on a copy of the env, its thought truthful."""
    def act(env, actions_left: int, cfg: RolloutConfig) -> tuple[list[str], str]:
        k = max(1, min(actions_per_turn, cfg.max_actions_per_turn, actions_left))
        plan = plan_on_copy(env, k, lambda sim: sim.expert_action())
        return plan, expert_thought(env.expert_note() if hasattr(env, "expert_note") else "", plan)
    return act
