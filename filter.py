"""StarPO-S's uncertainty filter (paper section 4.2): keep the prompt groups whose rollouts disagree the most.

A prompt's uncertainty is the unbiased std of its N rollouts' rewards (RAGEN's `rm_scores.std(dim=-1)`); the
top p% of prompts (p = 25%) are kept, each with all N rollouts. Why (section 4.1): a collapsing in-group std
is the Echo Trap's first warning, and a zero-std group carries no GRPO signal. Ties keep the lower index (a
stable sort); `filter_groups` applies a rule to an iteration's trajectories. RAGEN's later rules:
extras/filter_rules.py. Next: advantages.py.
"""

from __future__ import annotations

import torch

ZERO_STD = 1e-10  # RAGEN's zero-std threshold


def check_groups(group_rewards: torch.Tensor) -> None:
    """A ValueError unless rewards are [G, N], G >= 1, N >= 2, finite."""
    if not isinstance(group_rewards, torch.Tensor) or group_rewards.dim() != 2:
        shape = tuple(group_rewards.shape) if isinstance(group_rewards, torch.Tensor) else type(group_rewards)
        raise ValueError(f"group_rewards must be a 2-D tensor [G, N], got {shape}")
    G, N = group_rewards.shape
    if G == 0:
        raise ValueError("group_rewards is empty (G = 0 groups); nothing to filter")
    if N < 2:
        raise ValueError(f"each group needs at least 2 rollouts to have an in-group std, got N = {N}")
    if not bool(torch.isfinite(group_rewards).all()):
        raise ValueError("group_rewards contains NaN or inf")


def select_groups(group_rewards: torch.Tensor, keep: float = 0.25,
                  largest: bool = True) -> tuple[torch.Tensor, dict]:
    """The max(1, int(keep * G)) groups with the largest in-group reward std (`largest=False`: the smallest,
    the paper's ablation). group_rewards [G, N] -> (keep_mask [G] bool, `group_stats`)."""
    check_groups(group_rewards)
    if not 0 < keep <= 1:
        raise ValueError(f"keep must lie in (0, 1], got {keep}")
    G = group_rewards.shape[0]
    std = group_rewards.float().std(dim=1)  # [G], unbiased like RAGEN
    order = torch.sort(std, descending=largest, stable=True).indices  # [G], ties: the lower index first
    keep_mask = torch.zeros(G, dtype=torch.bool, device=group_rewards.device)
    keep_mask[order[:max(1, min(int(keep * G), G))]] = True
    return keep_mask, group_stats(std, keep_mask, std)


def filter_groups(trajs: list, groups: int, rule, cfg) -> tuple[list, dict, dict]:
    """Whole groups in or out: `trajs` in group order (G x N, each with its group_id) through `rule`
    (train.py's filter point: `select_groups` by --filter, or an option's) -> (the kept trajectories, the
    metrics logged under rollout/, the rule's `group_stats`)."""
    rewards = torch.tensor([t.reward for t in trajs]).view(groups, -1)  # [G, N]
    keep, stats = rule(rewards, cfg)  # [G] bool
    logged = ["in_group_std", "in_group_std_max", "chosen_in_group_std", "filter_kept", "zero_std_groups"]
    metrics = {f"rollout/{k}": stats[k] for k in logged}
    return [t for t in trajs if keep[t.group_id]], metrics, stats


def group_stats(std: torch.Tensor, keep_mask: torch.Tensor, score: torch.Tensor) -> dict:
    """What a filter logs, what it dropped included; all_zero_std: GRPO's advantages would all be 0."""
    kept = int(keep_mask.sum())
    zero = std <= ZERO_STD
    return {
        "in_group_std": float(std.mean()),
        "in_group_std_max": float(std.max()),
        "chosen_in_group_std": float(std[keep_mask].mean()) if kept else 0.0,
        "filter_kept": kept / len(std),
        "zero_std_groups": int(zero.sum()),
        "all_zero_std": bool(zero.all()),
        "kept_groups": torch.nonzero(keep_mask).flatten().tolist(),
        "dropped_groups": torch.nonzero(~keep_mask).flatten().tolist(),
        "empty_selection": kept == 0,
        "zero_score_groups": int((score.abs() <= ZERO_STD).sum()),
        "chosen_score": float(score[keep_mask].mean()) if kept else 0.0,
    }
