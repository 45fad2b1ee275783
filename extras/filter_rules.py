"""Group-selection rules beyond the paper (RAGEN HEAD's `RolloutFilter._select_top_groups` in
ragen/trainer/rollout_filter.py, and RAGEN-2's guide), opt-in through train.py's --filter-* flags.

- strategy `top_k`: the paper's rule (filter.py), `max(1, int(keep * G))` groups; `top_k_abs`: `keep` groups;
  `top_p` (linear): in score order until the cumulative score reaches keep x (the sum of all scores) -
  selection_eps, stopping at the first score <= 0 (if never reached, nothing is kept); `top_p` (softmax): the
  smallest prefix whose softmax(score) mass reaches keep; keep = 1 keeps every group; `min_p`: the groups
  whose score >= keep x the largest score.
- `include_zero=False` first drops the groups whose score is 0 (|score| <= 1e-10); if none is left, nothing.
- metric: the score a group is ranked by: `reward_std` (RAGEN's `reward_variance`, in fact the std),
  `reward_mean` (RAGEN's `reward`) or `reward_sum` of its N rewards.
- `largest=False` ranks the smallest scores first (top_k, top_p) or keeps scores <= min / keep (min_p).
RAGEN's HEAD default is top_p 1.0 (no filtering); RAGEN-2's guide: top_p 0.9, linear, include_zero off. Bad
settings raise ValueError (RAGEN checks none); an empty selection is the caller's to skip (train.py logs it).
"""
from __future__ import annotations

import torch

from filter import ZERO_STD, check_groups, group_stats

STRATEGIES = ("top_k", "top_k_abs", "top_p", "min_p")
METRICS = ("reward_std", "reward_mean", "reward_sum")
TOP_P_MODES = ("linear", "softmax")


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


def select_groups_by_rule(group_rewards: torch.Tensor, keep: float = 0.25, largest: bool = True,
                          strategy: str = "top_k", include_zero: bool = True, top_p_mode: str = "linear",
                          selection_eps: float = 0.01,
                          metric: str = "reward_std") -> tuple[torch.Tensor, dict]:
    """Keep whole prompt groups by a score of their rewards (the module docstring's rules); with the defaults,
    filter.select_groups. group_rewards: [G, N]. -> (keep_mask [G] bool, may be all False except with
    top_k/top_k_abs and include_zero, filter.group_stats)."""
    check_groups(group_rewards)
    if strategy not in STRATEGIES:
        raise ValueError(f"unknown filter strategy {strategy!r}; expected one of {', '.join(STRATEGIES)}")
    if metric not in METRICS:
        raise ValueError(f"unknown filter metric {metric!r}; expected one of {', '.join(METRICS)}")
    if top_p_mode not in TOP_P_MODES:
        raise ValueError(f"unknown top_p mode {top_p_mode!r}; expected one of {', '.join(TOP_P_MODES)}")
    if strategy == "top_k_abs":
        if isinstance(keep, bool) or not float(keep).is_integer() or keep < 1:
            raise ValueError(f"top_k_abs keeps a number of groups: keep must be a whole number >= 1, got "
                             f"{keep}")
    elif not 0 < keep <= 1:
        raise ValueError(f"{strategy} keep must lie in (0, 1], got {keep}")
    G = group_rewards.shape[0]
    rewards = group_rewards.float()
    std = rewards.std(dim=1)  # [G], unbiased like RAGEN
    score = {"reward_std": std, "reward_mean": rewards.mean(dim=1), "reward_sum": rewards.sum(dim=1)}[metric]
    candidates = torch.arange(G, device=group_rewards.device)  # [G] group indices still in the running
    if not include_zero:
        candidates = candidates[score.abs() > ZERO_STD]
    keep_mask = torch.zeros(G, dtype=torch.bool, device=group_rewards.device)  # [G]
    if candidates.numel() > 0:
        chosen = _choose(score[candidates], G, keep, largest, strategy, top_p_mode, selection_eps)
        keep_mask[candidates[chosen]] = True
    return keep_mask, group_stats(std, keep_mask, score)


# ---- train.py's --filter-* options, plugged into its loop

def plug(cfg, points: dict, run: dict) -> None:
    """The rules replace the paper's filter when a rule, a metric or the zero-group switch differs from the
    paper's; --filter-empty-stop K adds a hook that ends the run after K empty selections in a row."""
    if (cfg.filter_strategy, cfg.filter_metric, cfg.filter_include_zero) != ("top_k", "reward_std", True):
        points["filter"] = rule_filter
    if cfg.filter_empty_stop:
        points["after_update"].append(empty_stop(cfg.filter_empty_stop))


def rule_filter(group_rewards: torch.Tensor, cfg) -> tuple[torch.Tensor, dict]:
    """train.py's filter point with the run's --filter-* values."""
    return select_groups_by_rule(group_rewards, cfg.filter, not cfg.filter_smallest, cfg.filter_strategy,
                                 cfg.filter_include_zero, cfg.filter_top_p_mode, cfg.filter_eps,
                                 cfg.filter_metric)


def empty_stop(patience: int):
    """A hook after the update: a reason to stop once `patience` iterations in a row kept no group."""
    empty_run = [0]

    def hook(it: int, trajs: list, m: dict) -> str | None:
        empty_run[0] = empty_run[0] + 1 if m["train/skipped_empty_filter"] else 0
        if empty_run[0] >= patience:
            return f"the filter kept no group {empty_run[0]} iterations in a row (--filter-empty-stop)"
        return None
    return hook
