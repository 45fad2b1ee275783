"""Tests for filter.py (StarPO-S uncertainty filtering) against a slow loop with Python's statistics module.

Run from the repository root:  python -m pytest -q tests/test_filter.py   (about 1 s)
"""
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from filter import select_groups  # noqa: E402

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
