"""StarPO-S uncertainty filtering: keep the prompt groups whose rollouts disagree the most.

Paper: RAGEN section 4.2. For every initial state (prompt) the policy samples N trajectories; the prompt's
uncertainty is U = std of those N trajectory rewards. Prompts are sorted by U and only the top p% are kept
(default p = 25%). A prompt's N trajectories enter or leave the update together. Section 4.1 explains why this
helps: a collapsing in-group std is the first warning of the Echo Trap, and zero-std groups carry no GRPO signal.

Std definition: the unbiased (Bessel-corrected, divide by N - 1) std, exactly what RAGEN computes
(`rm_scores.std(dim=-1)` in ragen/trainer/rollout_filter.py, torch's default correction=1).

Deliberate deviations from the paper / RAGEN:
1. RAGEN's current default is a "top_p" cumulative-score rule; this is the paper's (RAGEN's "top_k"): keep
   `max(1, int(keep * G))` groups, truncated as RAGEN does (0.29 * 100 = 28.999... keeps 28).
2. Ties are broken deterministically, lower group index first (a stable sort); RAGEN's `topk` leaves ties to
   the backend.
3. A group counts as zero-std when its std is <= 1e-10 (RAGEN's threshold for its zero count).
"""

from __future__ import annotations

import torch

ZERO_STD = 1e-10


def select_groups(group_rewards: torch.Tensor, keep: float = 0.25,
                  largest: bool = True) -> tuple[torch.Tensor, dict]:
    """Keep the `max(1, int(keep * G))` prompt groups with the largest (or, with `largest=False`, the smallest:
    the paper's reverse ablation) in-group reward std; `keep=1.0` keeps every group.

    group_rewards: [G, N] total reward of each of the N trajectories of each of the G prompts.
    Returns (keep_mask [G] bool, stats): in_group_std and in_group_std_max (mean and max over all G groups),
    chosen_in_group_std (mean over the kept groups), filter_kept (fraction kept), zero_std_groups (how many have
    std <= 1e-10), all_zero_std (all of them: GRPO advantages are all 0, so the caller logs and skips the update
    rather than train on a silent zero loss), kept_groups and dropped_groups (lists of group indices).
    """
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

    std = group_rewards.float().std(dim=1)  # [G], unbiased like RAGEN
    k = max(1, int(keep * G))
    # stable sort: among equal stds the lower group index comes first in both directions
    order = torch.sort(std, descending=largest, stable=True).indices  # [G]
    keep_mask = torch.zeros(G, dtype=torch.bool, device=group_rewards.device)  # [G]
    keep_mask[order[:k]] = True

    zero = std <= ZERO_STD
    stats = {
        "in_group_std": float(std.mean()),
        "in_group_std_max": float(std.max()),
        "chosen_in_group_std": float(std[keep_mask].mean()),
        "filter_kept": k / G,
        "zero_std_groups": int(zero.sum()),
        "all_zero_std": bool(zero.all()),
        "kept_groups": torch.nonzero(keep_mask).flatten().tolist(),
        "dropped_groups": torch.nonzero(~keep_mask).flatten().tolist(),
    }
    return keep_mask, stats
