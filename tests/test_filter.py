"""Tests for filter.py (StarPO-S uncertainty filtering) against a slow loop with Python's statistics module, and
RAGEN's later strategies (top_k_abs, top_p, min_p, include_zero, metrics) against a transcription of RAGEN's code.

Run from the repository root:  python -m pytest -q tests/test_filter.py   (about 1 s)
"""
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from extras.filter_rules import select_groups_by_rule  # noqa: E402
from filter import filter_groups, select_groups  # noqa: E402

torch.set_num_threads(1)


def slow_select(rewards, keep, largest):
    stds = [statistics.stdev([float(x) for x in row]) for row in rewards]  # unbiased, as RAGEN
    k = max(1, int(keep * len(stds)))
    # ties: lower index first, in both directions
    order = sorted(range(len(stds)), key=lambda g: (-stds[g] if largest else stds[g], g))
    kept = sorted(order[:k])
    return kept, stds


@pytest.mark.parametrize("keep", [0.25, 0.5, 0.75, 1.0, 0.01])
@pytest.mark.parametrize("largest", [True, False])
def test_select_groups_matches_loop(keep, largest):
    gen = torch.Generator().manual_seed(0)
    # binary-ish rewards as in Sokoban/FrozenLake: many tied stds and some zero-std groups
    rewards = torch.randint(0, 3, (12, 8), generator=gen).float() - 0.1 * torch.randint(0, 2, (12, 8), generator=gen)
    rewards[3] = 1.0
    rewards[7] = -0.1
    mask, stats = select_groups(rewards, keep=keep, largest=largest)
    kept, stds = slow_select(rewards, keep, largest)
    assert mask.dtype == torch.bool and mask.shape == (12,)
    assert torch.nonzero(mask).flatten().tolist() == kept
    assert stats["kept_groups"] == kept
    assert stats["dropped_groups"] == [g for g in range(12) if g not in kept]
    assert stats["filter_kept"] == pytest.approx(len(kept) / 12)
    assert stats["in_group_std"] == pytest.approx(statistics.fmean(stds), abs=1e-6)
    assert stats["in_group_std_max"] == pytest.approx(max(stds), abs=1e-6)
    assert stats["chosen_in_group_std"] == pytest.approx(statistics.fmean(stds[g] for g in kept), abs=1e-6)
    assert stats["zero_std_groups"] == sum(s == 0 for s in stds)
    assert stats["all_zero_std"] is False


def test_ties_break_to_lower_index_and_paper_default():
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.0, 1.0],
                            [0.0, 0.0], [0.0, 2.0], [0.0, 0.0], [1.0, 1.0]])  # G = 8, stds: .71 0 .71 .71 0 1.4 0 0
    mask, stats = select_groups(rewards)  # keep 25% -> 2 groups
    assert torch.nonzero(mask).flatten().tolist() == [0, 5]  # 5 is largest; among the .71 ties, group 0
    mask, _ = select_groups(rewards, keep=0.5, largest=False)  # the four zero-std groups
    assert torch.nonzero(mask).flatten().tolist() == [1, 4, 6, 7]
    assert stats["zero_std_groups"] == 4


def test_keep_all_and_all_zero_std_is_reported():
    rewards = torch.ones(4, 3)
    mask, stats = select_groups(rewards, keep=1.0)
    assert mask.all()
    assert stats["all_zero_std"] is True and stats["zero_std_groups"] == 4
    assert stats["chosen_in_group_std"] == 0.0 and stats["dropped_groups"] == []
    mask, stats = select_groups(rewards, keep=0.1)  # at least one group is always kept
    assert mask.sum() == 1 and stats["kept_groups"] == [0]


@pytest.mark.parametrize("bad,kw,match", [
    (torch.zeros(0, 3), {}, "empty"),
    (torch.zeros(4, 1), {}, "at least 2"),
    (torch.zeros(12), {}, "2-D"),
    (torch.tensor([[0.0, float("nan")]]), {}, "NaN"),
])
def test_bad_inputs_raise(bad, kw, match):
    with pytest.raises(ValueError, match=match):
        select_groups(bad, **kw)


# --------------------------------------------------------------------------------------------------------
# RAGEN's later strategies against a transcription of RAGEN's RolloutFilter._select_top_groups
# --------------------------------------------------------------------------------------------------------

def ragen_select(rewards, value, largest, strategy, include_zero, mode, eps, metric):
    """RAGEN's _select_top_groups (ragen/trainer/rollout_filter.py), line by line on Python lists, with ties to the
    lower group index (filter.py's deviation 2)."""
    rows = [[float(x) for x in row] for row in rewards]
    score = {"reward_std": [statistics.stdev(r) for r in rows], "reward_mean": [statistics.fmean(r) for r in rows],
             "reward_sum": [math.fsum(r) for r in rows]}[metric]
    num_groups = len(rows)
    indices = list(range(num_groups))
    if not include_zero:
        indices = [g for g in indices if abs(score[g]) > 1e-10]
        if not indices:
            return []
    f32 = lambda x: float(torch.tensor(x, dtype=torch.float32))  # noqa: E731  RAGEN's scores are float32
    s = {g: f32(score[g]) for g in indices}
    ranked = sorted(indices, key=lambda g: (-s[g] if largest else s[g], g))
    if strategy == "top_p":
        if value >= 1.0:
            return indices
        if mode == "softmax":
            logits = {g: s[g] if largest else -s[g] for g in indices}
            top = max(logits.values())
            z = math.fsum(math.exp(v - top) for v in logits.values())
            by_prob = sorted(indices, key=lambda g: (-logits[g], g))
            cum, k = 0.0, len(by_prob)
            for i, g in enumerate(by_prob):
                cum += math.exp(logits[g] - top) / z
                if cum >= value:
                    k = i + 1
                    break
            return sorted(by_prob[:k])
        threshold = value * math.fsum(s.values()) - eps
        cumulative, count = 0.0, 0
        for g in ranked:
            if cumulative >= threshold:
                break
            if s[g] <= 0:
                break
            cumulative += s[g]
            count += 1
        return sorted(ranked[:count]) if cumulative >= threshold else []
    if strategy in ("top_k", "top_k_abs"):
        k = int(value * num_groups) if strategy == "top_k" else int(value)
        k = max(min(k, len(indices)), 1)
        return sorted(ranked[:k])
    # min_p: RAGEN's arithmetic is on float32 tensors (there 1 + 1e-10 rounds to 1: value 1 keeps the minimum)
    if largest:
        return [g for g in indices if s[g] >= f32(f32(f32(max(s.values())) * value) - 1e-10)]
    return [g for g in indices if s[g] <= f32(f32(f32(min(s.values())) / f32(value + 1e-10)) + 1e-10)]



def rewards_for(kind, seed):
    gen = torch.Generator().manual_seed(seed)
    if kind == "binary":  # Sokoban/FrozenLake-like: ties and zero-std groups. Multiples of 1/4 over N = 8 keep
        # every mean and sum exact in float32, so tied groups tie exactly there too
        r = torch.randint(0, 2, (16, 8), generator=gen).float() - 0.25 * torch.randint(0, 2, (16, 8), generator=gen)
        r[2] = 1.0
        r[9] = 0.0  # zero std and zero mean
        return r
    return torch.randn(16, 8, generator=gen) * 2 + 0.5  # continuous, mixed signs


@pytest.mark.parametrize("kind", ["binary", "continuous"])
@pytest.mark.parametrize("metric", ["reward_std", "reward_mean", "reward_sum"])
@pytest.mark.parametrize("include_zero", [True, False])
@pytest.mark.parametrize("largest", [True, False])
@pytest.mark.parametrize("strategy,mode,value", [
    ("top_k", "linear", 0.25), ("top_k", "linear", 0.6), ("top_k_abs", "linear", 3), ("top_k_abs", "linear", 40),
    ("top_p", "linear", 0.9), ("top_p", "linear", 0.5), ("top_p", "linear", 1.0), ("top_p", "softmax", 0.9),
    ("top_p", "softmax", 0.3), ("min_p", "linear", 0.5), ("min_p", "linear", 1.0)])
def test_strategies_match_ragen_transcription(kind, metric, include_zero, largest, strategy, mode, value):
    for seed in range(3):
        rewards = rewards_for(kind, seed)
        mask, stats = select_groups_by_rule(rewards, keep=value, largest=largest, strategy=strategy,
                                    include_zero=include_zero, top_p_mode=mode, metric=metric)
        want = ragen_select(rewards, value, largest, strategy, include_zero, mode, 0.01, metric)
        assert stats["kept_groups"] == want == torch.nonzero(mask).flatten().tolist(), seed
        assert stats["filter_kept"] == pytest.approx(len(want) / 16)
        assert stats["empty_selection"] == (not want)
        assert stats["dropped_groups"] == [g for g in range(16) if g not in want]


def test_default_arguments_are_the_papers_rule():
    """With its defaults, extras/filter_rules.py is the paper's filter.select_groups, stats included."""
    for kind in ("binary", "continuous"):
        for seed in range(3):
            rewards = rewards_for(kind, seed)
            for keep, largest in ((0.25, True), (0.5, False), (1.0, True)):
                a, b = select_groups(rewards, keep, largest), select_groups_by_rule(rewards, keep, largest)
                assert torch.equal(a[0], b[0]) and a[1] == b[1]
    rewards = rewards_for("binary", 0)
    mask, stats = select_groups_by_rule(rewards)
    assert stats["kept_groups"] == slow_select(rewards, 0.25, True)[0]
    assert stats["empty_selection"] is False


def test_linear_top_p_by_hand():
    # stds 2.12, 1.41, 0.71, 0 (G = 4, N = 2): total 4.24; top_p 0.5 -> threshold 2.11: the first group suffices
    rewards = torch.tensor([[0.0, 3.0], [0.0, 2.0], [0.0, 1.0], [5.0, 5.0]])
    assert select_groups_by_rule(rewards, 0.5, strategy="top_p")[1]["kept_groups"] == [0]
    # 0.8 -> threshold 3.38: groups 0 and 1 (3.54)
    assert select_groups_by_rule(rewards, 0.8, strategy="top_p")[1]["kept_groups"] == [0, 1]
    # 0.999 -> threshold 4.23: all three non-zero groups (4.24), never the zero one
    assert select_groups_by_rule(rewards, 0.999, strategy="top_p")[1]["kept_groups"] == [0, 1, 2]
    # scores <= 0 stop the walk: mean rewards -1, -2, 3 with keep 0.9 -> threshold -0.01, reached at once: empty
    neg = torch.tensor([[-1.0, -1.0], [-2.0, -2.0], [3.0, 3.0]])
    mask, stats = select_groups_by_rule(neg, 0.9, strategy="top_p", metric="reward_mean")
    assert not mask.any() and stats["empty_selection"] is True and stats["filter_kept"] == 0
    assert stats["chosen_in_group_std"] == 0.0 and stats["chosen_score"] == 0.0
    # smallest-first linear: the first (smallest) score is <= 0, so the walk stops before the threshold: empty
    assert select_groups_by_rule(rewards, 0.5, largest=False, strategy="top_p")[1]["empty_selection"] is True


def test_empty_selections_are_reported_never_raised():
    flat = torch.ones(5, 4)  # every std 0
    for kw in ({"strategy": "top_p", "keep": 0.9}, {"strategy": "min_p", "keep": 0.5, "include_zero": False},
               {"strategy": "top_k", "keep": 0.25, "include_zero": False},
               {"strategy": "top_p", "keep": 0.9, "top_p_mode": "softmax", "include_zero": False}):
        mask, stats = select_groups_by_rule(flat, **kw)
        assert mask.dtype == torch.bool and not mask.any(), kw
        assert stats["empty_selection"] is True and stats["filter_kept"] == 0 and stats["kept_groups"] == []
        assert stats["all_zero_std"] is True and stats["zero_score_groups"] == 5
    # include_zero (the default) and top_k: still at least one group, as today
    assert select_groups_by_rule(flat, keep=0.25)[1]["kept_groups"] == [0]


def test_include_zero_off_drops_zero_groups_before_ranking():
    rewards = torch.tensor([[0.0, 0.0], [0.0, 1.0], [1.0, 1.0], [0.0, 2.0]])  # stds 0, .71, 0, 1.41
    assert select_groups_by_rule(rewards, keep=1.0)[0].all()
    assert select_groups_by_rule(rewards, keep=1.0, include_zero=False)[1]["kept_groups"] == [1, 3]
    # smallest first without zero groups: the smallest non-zero std
    assert select_groups_by_rule(rewards, keep=0.25, largest=False, include_zero=False)[1]["kept_groups"] == [1]
    assert select_groups_by_rule(rewards, keep=0.25, largest=False)[1]["kept_groups"] == [0]


def test_min_p_and_top_k_abs_by_hand():
    rewards = torch.tensor([[0.0, 4.0], [0.0, 2.0], [0.0, 1.0], [0.0, 3.0]])  # stds 2.83, 1.41, 0.71, 2.12
    assert select_groups_by_rule(rewards, 0.5, strategy="min_p")[1]["kept_groups"] == [0, 1, 3]  # >= 1.41
    assert select_groups_by_rule(rewards, 1.0, strategy="min_p")[1]["kept_groups"] == [0]
    assert select_groups_by_rule(rewards, 2, strategy="top_k_abs")[1]["kept_groups"] == [0, 3]
    assert select_groups_by_rule(rewards, 9, strategy="top_k_abs")[0].all()  # more than G: all of them
    stats = select_groups_by_rule(rewards, 2, strategy="top_k_abs", metric="reward_sum")[1]
    assert stats["kept_groups"] == [0, 3] and stats["chosen_score"] == pytest.approx(3.5)


def test_softmax_top_p_by_hand():
    # scores 0, ln 3 (means): softmax 1/4, 3/4 -> keep 0.7 needs only group 1, keep 0.8 both
    rewards = torch.tensor([[0.0, 0.0], [math.log(3), math.log(3)]])
    kw = dict(strategy="top_p", top_p_mode="softmax", metric="reward_mean")
    assert select_groups_by_rule(rewards, 0.7, **kw)[1]["kept_groups"] == [1]
    assert select_groups_by_rule(rewards, 0.8, **kw)[1]["kept_groups"] == [0, 1]


@pytest.mark.parametrize("kw,match", [
    ({"strategy": "top_q"}, "unknown filter strategy 'top_q'; expected one of top_k, top_k_abs, top_p, min_p"),
    ({"metric": "reward_var"}, "unknown filter metric 'reward_var'; expected one of reward_std, reward_mean"),
    ({"strategy": "top_p", "top_p_mode": "cubic"}, "unknown top_p mode"),
    ({"strategy": "top_p", "keep": 1.5}, r"top_p keep must lie in \(0, 1\], got 1.5"),
    ({"strategy": "top_p", "keep": 0.0}, r"top_p keep must lie in \(0, 1\]"),
    ({"strategy": "min_p", "keep": -0.5}, r"min_p keep must lie in \(0, 1\]"),
    ({"keep": 2.0}, r"top_k keep must lie in \(0, 1\]"),
    ({"strategy": "top_k_abs", "keep": 2.5}, "whole number >= 1"),
    ({"strategy": "top_k_abs", "keep": 0}, "whole number >= 1"),
])
def test_bad_settings_raise_one_line(kw, match):
    with pytest.raises(ValueError, match=match) as err:
        select_groups_by_rule(torch.rand(4, 3), **kw)
    assert "\n" not in str(err.value)


def test_filter_groups_keeps_whole_groups_and_logs_them():
    """filter_groups: a prompt's N trajectories are kept or dropped together, in their order, and the metrics
    logged under rollout/ are the rule's."""
    from types import SimpleNamespace as T
    rewards = [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 1.0, 1.0]]  # [G=4, N=3]
    trajs = [T(group_id=g, reward=r, k=k) for g, row in enumerate(rewards) for k, r in enumerate(row)]
    rule = lambda group_rewards, cfg: select_groups(group_rewards, 0.5)  # noqa: E731
    kept, metrics, stats = filter_groups(trajs, 4, rule, None)
    assert [(t.group_id, t.k) for t in kept] == [(1, 0), (1, 1), (1, 2), (3, 0), (3, 1), (3, 2)]
    assert metrics["rollout/filter_kept"] == 0.5 and metrics["rollout/zero_std_groups"] == 2
    assert stats["dropped_groups"] == [0, 2] and not stats["all_zero_std"]
