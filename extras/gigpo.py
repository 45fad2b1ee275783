"""GiGPO, beyond the paper (`--algo gigpo`): verl-agent's Group-in-Group Policy Optimization (arXiv
2505.10978, gigpo/core_gigpo.py in langfengQ/verl-agent), step-level credit without a critic.

A prompt group's rollouts start from one state and often meet the same states again later ("anchor states":
the same Sokoban board, the same FrozenLake cell; here the exact observation text). The turns taken from one
anchor state form a step group; their discounted returns from that turn, normalised within the step group, say
which action was better there. A turn's tokens get the episode advantage (GRPO's, paper eq. 3) plus `w` times
that step advantage (eq. 7-8). Sokoban and FrozenLake render states exactly, so matching is exact
(verl-agent's `enable_similarity=False`). Read after advantages.py (grpo_advantages) and
extras/turn_credit.py.
"""
from __future__ import annotations

from collections import defaultdict

import torch

from advantages import grpo_advantages, register

MODES = ("mean_norm", "mean_std_norm")


def _step_normalise(returns: list[float], keys: list, mode: str, eps: float) -> list[float]:
    """Each return minus its step group's mean (mean_std_norm: divided by its unbiased std + eps); a step
    group of one gets 0, its own mean (verl-agent's step_norm_reward)."""
    groups = defaultdict(list)
    for v, k in zip(returns, keys):
        groups[k].append(v)
    stats = {}
    for k, vs in groups.items():
        t = torch.tensor(vs, dtype=torch.float64)
        stats[k] = (float(t.mean()), float(t.std()) if len(vs) > 1 else 1.0)
    if mode == "mean_norm":
        return [v - stats[k][0] for v, k in zip(returns, keys)]
    return [(v - stats[k][0]) / (stats[k][1] + eps) for v, k in zip(returns, keys)]


def gigpo_advantages(episode_scores: torch.Tensor, group_ids, turn_states: list[list[str]],
                     turn_rewards: list[list[float]], gamma: float = 0.95, step_weight: float = 1.0,
                     mode: str = "mean_norm", eps: float = 1e-6) -> tuple[torch.Tensor, list[list[float]]]:
    """-> (episode_adv [B], step_adv: B lists, one float per turn, already times `step_weight`).

    Episode level (eq. 3): each trajectory's score against its prompt group, each trajectory counted once
    (verl-agent's `compute_mean_std_cross_steps=False`; its default, True, counts a trajectory once per step,
    so long episodes weigh more in the group's mean). Step level (eq. 6-7): step groups are (group id,
    identical state text); turn t's return is sum_k gamma^k r_{t+k} over that trajectory's turn rewards; its
    advantage is that return minus the step group's mean (`mean_std_norm`: divided by its unbiased std + eps;
    verl-agent's `mode` applies to both levels, as here). A step group of one gets 0 (its own mean), as in
    verl-agent; a prompt group of one gets 0 as in grpo_advantages (verl-agent: its raw score; train.py's N is
    >= 2).
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r}: allowed are {', '.join(MODES)}")
    episode = grpo_advantages(episode_scores, list(group_ids), eps, norm_by_std=mode == "mean_std_norm")
    keys, returns, where = [], [], []
    for b, (g, states, rewards) in enumerate(zip(group_ids, turn_states, turn_rewards)):
        if len(states) != len(rewards):
            raise ValueError(f"trajectory {b}: {len(states)} turn states but {len(rewards)} turn rewards")
        ret = 0.0
        back = []
        for r in reversed(rewards):  # discounted return from each turn on
            ret = r + gamma * ret
            back.append(ret)
        for t, (s, ret) in enumerate(zip(states, reversed(back))):
            keys.append((g, s))
            returns.append(ret)
            where.append((b, t))
    flat = _step_normalise(returns, keys, mode, eps)
    step = [[0.0] * len(s) for s in turn_states]
    for (b, t), a in zip(where, flat):
        step[b][t] = step_weight * a
    return episode.float(), step


def step_groups(group_ids, turn_states: list[list[str]]) -> dict:
    """What the step level found: the mean size of the step groups and the share of turns in a group of >= 2
    (at small scale anchor states may rarely repeat; these say so)."""
    sizes = defaultdict(int)
    for g, states in zip(group_ids, turn_states):
        for s in states:
            sizes[(g, s)] += 1
    turns = sum(sizes.values())
    return {"group_size": turns / max(1, len(sizes)),
            "grouped_turns": sum(n for n in sizes.values() if n >= 2) / max(1, turns)}


def gigpo_token_advantages(kept, rows, mask: torch.Tensor, cfg) -> tuple[torch.Tensor, dict]:
    """The estimator's work: kept trajectories, rows = (segment, trajectory) per batch row, mask
    [B, T] the trained tokens. Each turn's sampled tokens (up to and including its recorded reply end,
    Segment.reply_ends) get episode_adv + w * step_adv[turn]. -> (advantages [B, T], metrics)."""
    gids = [t.group_id for t in kept]
    states = [[u.obs for u in t.turns] for t in kept]
    episode, step = gigpo_advantages(torch.tensor([t.reward for t in kept]), gids, states,
                                     [[u.reward for u in t.turns] for t in kept], cfg.gigpo_gamma,
                                     cfg.gigpo_weight, cfg.gigpo_mode)
    index = {id(t): b for b, t in enumerate(kept)}
    per_turn = torch.zeros(mask.shape, dtype=torch.float32)  # [B, T] each token's turn advantage
    seen = defaultdict(int)  # turns met so far per trajectory (a window per turn: one reply per segment)
    for r, (seg, traj) in enumerate(rows):
        b = index[id(traj)]
        start = 0
        for end in seg.reply_ends:
            turn = seen[b]
            per_turn[r, start:end + 1] = float(episode[b]) + step[b][turn]
            start, seen[b] = end + 1, turn + 1
    adv = per_turn.to(mask.device) * (mask > 0)
    found = step_groups(gids, states)
    metrics = {"rollout/gigpo_group_size": found["group_size"],
               "rollout/gigpo_grouped_turns": found["grouped_turns"]}
    return adv, metrics


def has_signal(kept, cfg) -> bool:
    """Whether GiGPO gives any token a non-zero advantage: with every prompt group's rewards equal, turns from
    one state may still differ in their discounted returns (a shorter path), so GRPO's zero-std skip is not
    GiGPO's."""
    if not kept:
        return False
    episode, step = gigpo_advantages(torch.tensor([t.reward for t in kept]), [t.group_id for t in kept],
                                     [[u.obs for u in t.turns] for t in kept],
                                     [[u.reward for u in t.turns] for t in kept], cfg.gigpo_gamma,
                                     cfg.gigpo_weight, cfg.gigpo_mode)
    return bool(episode.abs().max() > 1e-9) or any(abs(a) > 1e-9 for s in step for a in s)


@register("gigpo", signal_without_spread=has_signal)
def gigpo(kept, rows, batch, cfg):
    """`--algo gigpo` (advantages.ESTIMATORS): GiGPO's token advantages, no critic."""
    advantages, metrics = gigpo_token_advantages(kept, rows, batch.loss_mask, cfg)
    return advantages, None, metrics
