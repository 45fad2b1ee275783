"""StarPO-S uncertainty filtering: keep the prompt groups whose rollouts disagree the most.

Paper: RAGEN section 4.2. For every initial state (prompt) the policy samples N trajectories; the prompt's
uncertainty is U = std of those N trajectory rewards. Prompts are sorted by U and only the top p% are kept
(default p = 25%). A prompt's N trajectories enter or leave the update together. Section 4.1 explains why this
helps: a collapsing in-group std is the first warning of the Echo Trap, and zero-std groups carry no GRPO signal.

Std definition: the unbiased (Bessel-corrected, divide by N - 1) std, exactly what RAGEN computes
(`rm_scores.std(dim=-1)` in ragen/trainer/rollout_filter.py, torch's default correction=1).

RAGEN's later rules (`RolloutFilter._select_top_groups` in ragen/trainer/rollout_filter.py, RAGEN-2), as keywords:
- strategy `top_k`: the paper's rule, `max(1, int(keep * G))` groups; `top_k_abs`: `keep` groups (an int);
  `top_p` (linear mode): sort by score, take groups in order until their cumulative score reaches
  keep x (sum of all scores) - selection_eps, stopping at the first score <= 0; if the threshold is never
  reached, keep nothing; `top_p` (softmax mode): the smallest prefix whose softmax(score) mass reaches keep;
  `top_p` with keep = 1 keeps every group; `min_p`: the groups whose score >= keep x the largest score.
- `include_zero=False` first drops the groups whose score is 0 (|score| <= 1e-10); if none is left, nothing is kept.
- metric: the score a group is ranked by: `reward_std`, `reward_mean` or `reward_sum` of its N rewards.
- `largest=False` ranks the smallest scores first (top_k, top_p) or keeps scores <= min / keep (min_p), as RAGEN.

Deliberate deviations from the paper / RAGEN:
1. The default is the paper's rule (RAGEN's "top_k" on the std). RAGEN's HEAD defaults (config/base.yaml) are
   `top_p` with value 1.0, i.e. no filtering; its RAGEN-2 guide recommends top_p 0.9, linear, include_zero off.
   `top_k` truncates as RAGEN does (0.29 * 100 = 28.999... keeps 28).
2. Ties are broken deterministically, lower group index first (a stable sort, in every strategy); RAGEN's
   `topk` and `sort` leave ties to the backend.
3. A group counts as zero-std (zero-score) when its std (score) is <= 1e-10 in absolute value, RAGEN's threshold.
4. Metric names: RAGEN's `reward_variance` is in fact the std (here `reward_std`), its `reward` is the mean
   (here `reward_mean`).
5. Bad settings raise ValueError (RAGEN checks none): keep must lie in (0, 1] for top_k, top_p and min_p, and be
   a whole number >= 1 for top_k_abs.
6. An empty selection (possible with top_p, min_p or include_zero=False) returns an all-False mask with
   stats["empty_selection"] = True and chosen means of 0 (RAGEN's `_selected_mean`); skipping the update is the
   caller's job, as RAGEN's trainer skips the step.
"""

from __future__ import annotations

import torch

ZERO_STD = 1e-10
STRATEGIES = ("top_k", "top_k_abs", "top_p", "min_p")
METRICS = ("reward_std", "reward_mean", "reward_sum")
TOP_P_MODES = ("linear", "softmax")


def _check(group_rewards, keep, strategy, top_p_mode, metric) -> None:
    """One clear ValueError line for each bad argument."""
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
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown filter strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    if metric not in METRICS:
        raise ValueError(f"unknown filter metric {metric!r}; expected one of {', '.join(METRICS)}")
    if top_p_mode not in TOP_P_MODES:
        raise ValueError(f"unknown top_p mode {top_p_mode!r}; expected one of {', '.join(TOP_P_MODES)}")
    if strategy == "top_k_abs":
        if isinstance(keep, bool) or not float(keep).is_integer() or keep < 1:
            raise ValueError(f"top_k_abs keeps a number of groups: keep must be a whole number >= 1, got {keep}")
    elif not 0 < keep <= 1:
        raise ValueError(f"{strategy} keep must lie in (0, 1], got {keep}")


def _choose(score: torch.Tensor, G: int, keep: float, largest: bool, strategy: str, top_p_mode: str,
            selection_eps: float) -> torch.Tensor:
    """Positions (into `score`, the candidate groups' scores in group order) of the groups to keep."""
    n = score.numel()
    # stable: among equal scores the lower group index comes first, in both directions
    order = torch.sort(score, descending=largest, stable=True).indices  # [n]
    if strategy in ("top_k", "top_k_abs"):
        k = int(keep * G) if strategy == "top_k" else int(keep)  # a fraction of all G groups, or a count
        return order[:max(1, min(k, n))]
    if strategy == "min_p":
        if largest:
            return torch.nonzero(score >= score.max() * keep - ZERO_STD).flatten()
        # RAGEN's mirror image: keep the scores "close enough" to the smallest one
        return torch.nonzero(score <= score.min() / (keep + ZERO_STD) + ZERO_STD).flatten()
    if keep >= 1.0:  # top_p 1: every candidate (RAGEN returns before sorting)
        return torch.arange(n, device=score.device)
    if top_p_mode == "softmax":
        probs = torch.softmax(score if largest else -score, dim=0)
        by_prob = torch.sort(probs, descending=True, stable=True).indices
        # the first position whose cumulative mass reaches keep, included
        k = int(torch.searchsorted(torch.cumsum(probs[by_prob], dim=0), keep)) + 1
        return by_prob[:min(k, n)]
    # linear: RAGEN's loop, its float32 threshold compared with a running Python sum as RAGEN compares them
    threshold = keep * score.sum() - selection_eps
    total, count = 0.0, 0
    for s in score[order].tolist():
        if total >= threshold or s <= 0:  # reached, or no positive score left to add
            break
        total += s
        count += 1
    return order[:count] if total >= threshold else order[:0]


def select_groups(group_rewards: torch.Tensor, keep: float = 0.25, largest: bool = True, strategy: str = "top_k",
                  include_zero: bool = True, top_p_mode: str = "linear", selection_eps: float = 0.01,
                  metric: str = "reward_std") -> tuple[torch.Tensor, dict]:
    """Keep whole prompt groups by a score of their rewards (the module docstring's rules). The default is the
    paper's: the `max(1, int(keep * G))` groups with the largest (or, with `largest=False`, the smallest: the
    paper's reverse ablation) in-group reward std; `keep=1.0` keeps every group.

    group_rewards: [G, N] total reward of each of the N trajectories of each of the G prompts.
    Returns (keep_mask [G] bool, may be all False except with top_k/top_k_abs and include_zero, stats):
    in_group_std and in_group_std_max (mean and max over all G groups), chosen_in_group_std (mean over the kept
    groups, 0 if none), filter_kept (fraction kept), zero_std_groups (how many have std <= 1e-10), all_zero_std
    (all of them: GRPO advantages are all 0, so the caller logs and skips the update rather than train on a
    silent zero loss), kept_groups and dropped_groups (lists of group indices), empty_selection (no group kept:
    the caller skips the update), zero_score_groups (groups whose `metric` score is 0), chosen_score (mean score
    of the kept groups, 0 if none).
    """
    _check(group_rewards, keep, strategy, top_p_mode, metric)
    G = group_rewards.shape[0]
    rewards = group_rewards.float()
    std = rewards.std(dim=1)  # [G], unbiased like RAGEN
    score = {"reward_std": std, "reward_mean": rewards.mean(dim=1), "reward_sum": rewards.sum(dim=1)}[metric]  # [G]

    candidates = torch.arange(G, device=group_rewards.device)  # [G] group indices still in the running
    if not include_zero:
        candidates = candidates[score.abs() > ZERO_STD]
    keep_mask = torch.zeros(G, dtype=torch.bool, device=group_rewards.device)  # [G]
    if candidates.numel() > 0:
        keep_mask[candidates[_choose(score[candidates], G, keep, largest, strategy, top_p_mode, selection_eps)]] = True

    kept = int(keep_mask.sum())
    zero = std <= ZERO_STD
    stats = {
        "in_group_std": float(std.mean()),
        "in_group_std_max": float(std.max()),
        "chosen_in_group_std": float(std[keep_mask].mean()) if kept else 0.0,
        "filter_kept": kept / G,
        "zero_std_groups": int(zero.sum()),
        "all_zero_std": bool(zero.all()),
        "kept_groups": torch.nonzero(keep_mask).flatten().tolist(),
        "dropped_groups": torch.nonzero(~keep_mask).flatten().tolist(),
        "empty_selection": kept == 0,
        "zero_score_groups": int((score.abs() <= ZERO_STD).sum()),
        "chosen_score": float(score[keep_mask].mean()) if kept else 0.0,
    }
    return keep_mask, stats
