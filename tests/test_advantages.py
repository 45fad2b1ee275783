"""Tests for advantages.py: every estimator against a slow, explicit per-row loop.

Run from the repository root:  python -m pytest -q tests/test_advantages.py   (about 2 s on one core)

Masks are random with holes between turns (environment messages inside a trajectory) and include all-masked
rows; the loops re-derive each quantity from its textbook definition on plain Python floats.
"""
import math
import statistics
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from advantages import (broadcast_to_tokens, gae, grpo_advantages, kl_penalized_rewards,  # noqa: E402
                        place_reward_on_last_token, whiten)
from extras.turn_credit import at_positions, bi_level_gae  # noqa: E402

torch.set_num_threads(1)


def multi_turn_mask(B, T, gen, empty_rows=(1,)):
    """[B, T] mask: prompt, then alternating reply segments (1) and env messages (0), then right padding."""
    mask = torch.zeros(B, T)
    for b in range(B):
        if b in empty_rows:
            continue
        t = int(torch.randint(1, 4, (1,), generator=gen))  # prompt
        end = T - int(torch.randint(0, 5, (1,), generator=gen))  # padding
        sampled = True
        while t < end:
            seg = int(torch.randint(1, 5, (1,), generator=gen))
            if sampled:
                mask[b, t:min(t + seg, end)] = 1
            t += seg
            sampled = not sampled
    return mask


def test_place_reward_on_last_token_matches_loop():
    gen = torch.Generator().manual_seed(0)
    mask = multi_turn_mask(6, 20, gen, empty_rows=(2, 5))
    scores = torch.randn(6, generator=gen)
    out = place_reward_on_last_token(scores, mask)
    for b in range(6):
        sampled = [t for t in range(20) if mask[b, t] == 1]
        for t in range(20):
            want = float(scores[b]) if sampled and t == sampled[-1] else 0.0
            assert out[b, t].item() == pytest.approx(want)
    assert out[2].abs().sum() == 0 and out[5].abs().sum() == 0


def slow_gae(rewards, values, mask, gamma, lam):
    """GAE on the compressed sequence of sampled tokens of each row, written back to their positions."""
    B, T = mask.shape
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        pos = [t for t in range(T) if mask[b, t] == 1]
        running = 0.0
        for i in reversed(range(len(pos))):
            t = pos[i]
            next_v = float(values[b, pos[i + 1]]) if i + 1 < len(pos) else 0.0
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            running = delta + gamma * lam * running
            adv[b][t] = running
    return torch.tensor(adv)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0)])
def test_gae_matches_loop_across_env_messages(gamma, lam):
    gen = torch.Generator().manual_seed(1)
    mask = multi_turn_mask(7, 30, gen, empty_rows=(3,))
    values = torch.randn(7, 30, generator=gen)
    rewards = torch.randn(7, 30, generator=gen) * mask  # per-token rewards on sampled tokens only
    adv, ret = gae(rewards, values, mask, gamma, lam)
    want = slow_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, adv + values)
    assert adv[3].abs().sum() == 0  # all-masked row
    assert (adv[mask == 0] == 0).all()


def test_gae_trajectory_reward_gamma_lam_one_gives_reward_minus_value():
    # paper setting (gamma = lambda = 1, reward on the last sampled token): A_t = R - V_t on every sampled token
    gen = torch.Generator().manual_seed(2)
    mask = multi_turn_mask(5, 25, gen, empty_rows=())
    scores = torch.randn(5, generator=gen)
    values = torch.randn(5, 25, generator=gen)
    adv, _ = gae(place_reward_on_last_token(scores, mask), values, mask)
    want = (scores[:, None] - values) * mask
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)


def test_gae_ignores_nonfinite_values_on_skipped_tokens_and_rejects_misplaced_rewards():
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 0.0]])
    values = torch.tensor([[float("nan"), 0.5, 0.2, float("inf"), 3.0, 0.1, float("nan")]])
    rewards = torch.tensor([[0, 0, 0, 0, 0, 1.0, 0]])
    adv, _ = gae(rewards, values, mask)
    assert torch.isfinite(adv).all()
    torch.testing.assert_close(adv, slow_gae(rewards, torch.nan_to_num(values), mask, 1.0, 1.0))
    with pytest.raises(ValueError, match="outside mask"):
        gae(torch.tensor([[0, 0, 0, 1.0, 0, 0, 0]]), torch.zeros(1, 7), mask)


def test_whiten_matches_loop():
    gen = torch.Generator().manual_seed(3)
    mask = multi_turn_mask(4, 16, gen)
    x = torch.randn(4, 16, generator=gen) * 3 + 2
    out = whiten(x, mask)
    vals = [float(x[b, t]) for b in range(4) for t in range(16) if mask[b, t] == 1]
    mean, var = statistics.fmean(vals), statistics.variance(vals)  # unbiased, as verl's masked_whiten
    for b in range(4):
        for t in range(16):
            want = (float(x[b, t]) - mean) / math.sqrt(var + 1e-8)
            assert out[b, t].item() == pytest.approx(want if mask[b, t] == 1 else 0.0, abs=1e-5)
    with pytest.raises(ValueError, match="at least 2"):
        whiten(x, torch.zeros(4, 16))


def slow_grpo(scores, ids, eps, norm_by_std):
    out = []
    for i, g in enumerate(ids):
        members = [float(scores[j]) for j, h in enumerate(ids) if h == g]
        if len(members) == 1:
            out.append(0.0)
            continue
        mean = statistics.fmean(members)
        a = float(scores[i]) - mean
        out.append(a / (statistics.stdev(members) + eps) if norm_by_std else a)
    return torch.tensor(out)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_matches_loop_with_ties_zero_variance_and_singletons(norm_by_std):
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0,  # group 7: ties
                           0.5, 0.5, 0.5,  # group 3: zero variance -> 0
                           2.0,  # group 9: a group of one -> 0
                           -0.1, 1.0, 0.0, 1.0])  # group 4, interleaved below
    ids = torch.tensor([7, 7, 7, 7, 3, 3, 3, 9, 4, 4, 4, 4])
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(4))  # groups need not be contiguous
    scores, ids = scores[perm], ids[perm]
    out = grpo_advantages(scores, ids, norm_by_std=norm_by_std)
    torch.testing.assert_close(out, slow_grpo(scores, ids.tolist(), 1e-6, norm_by_std), atol=1e-6, rtol=1e-5)
    assert (out[ids == 3] == 0).all() and (out[ids == 9] == 0).all()
    # group ids may be any hashables (e.g. prompt seeds as strings)
    out_str = grpo_advantages(scores, [f"seed{int(i)}" for i in ids], norm_by_std=norm_by_std)
    torch.testing.assert_close(out_str, out)


def test_grpo_random_against_loop():
    gen = torch.Generator().manual_seed(5)
    ids = torch.randint(0, 6, (40,), generator=gen)
    scores = torch.randint(-2, 3, (40,), generator=gen).float() * 0.5  # many ties
    torch.testing.assert_close(grpo_advantages(scores, ids), slow_grpo(scores, ids.tolist(), 1e-6, True),
                               atol=1e-5, rtol=1e-5)


def test_broadcast_to_tokens():
    gen = torch.Generator().manual_seed(6)
    mask = multi_turn_mask(3, 10, gen)
    adv = torch.tensor([1.5, -2.0, 0.25])
    out = broadcast_to_tokens(adv, mask)
    for b in range(3):
        for t in range(10):
            assert out[b, t].item() == (adv[b].item() if mask[b, t] == 1 else 0.0)


def test_kl_penalized_rewards_matches_loop():
    """RAGEN's apply_kl_penalty: r_t - coef * (old_logp_t - ref_logp_t) on every trained token, 0 change elsewhere."""
    gen = torch.Generator().manual_seed(3)
    B, T = 5, 12
    mask = multi_turn_mask(B, T, gen)
    rewards = place_reward_on_last_token(torch.randn(B, generator=gen), mask)
    old, ref = torch.randn(B, T, generator=gen), torch.randn(B, T, generator=gen)
    out = kl_penalized_rewards(rewards, old, ref, mask, 0.01)
    for b in range(B):
        for t in range(T):
            want = rewards[b, t].item() - (0.01 * (old[b, t].item() - ref[b, t].item()) if mask[b, t] else 0.0)
            assert out[b, t].item() == pytest.approx(want, abs=1e-6)
    adv, _ = gae(out, torch.zeros(B, T), mask)  # still a valid GAE input: nothing outside the mask
    assert adv.shape == (B, T)


# --------------------------------------------------------------------------------------------------------
# bi-level GAE against a transcription of RAGEN's compute_bi_level_gae_advantage_return
# --------------------------------------------------------------------------------------------------------

def ragen_bi_level_gae(rewards, values, mask, gamma, lam, high_level_gamma, eos=None):
    """RAGEN's loop (ragen/trainer/core_algos.py) on Python floats, without its final whitening. Turn ends are the
    non-zero-reward tokens, as RAGEN finds them, unless `eos` [B][positions] gives them."""
    B, T = mask.shape
    r = [[float(x) for x in row] for row in rewards]
    v = [[float(x) for x in row] for row in values]
    adv = [[0.0] * T for _ in range(B)]
    for b in range(B):
        updated = list(r[b])
        eos_positions = [t for t in range(T) if r[b][t] != 0] if eos is None else eos[b]
        lastgaelam = 0.0
        for i in range(len(eos_positions) - 1, -1, -1):
            curr = eos_positions[i]
            nextvalue = v[b][eos_positions[i + 1]] if i < len(eos_positions) - 1 else 0.0
            delta = updated[curr] + high_level_gamma * nextvalue - v[b][curr]
            lastgaelam = delta + high_level_gamma * lam * lastgaelam
            adv[b][curr] = lastgaelam
        for pos in eos_positions:
            updated[pos] = adv[b][pos] + v[b][pos]
        lastgaelam = 0.0
        valid = [t for t in range(T) if mask[b, t] == 1]
        for i in range(len(valid) - 1, -1, -1):
            curr = valid[i]
            if curr not in eos_positions:
                nextvalue = v[b][valid[i + 1]]
            else:
                nextvalue = 0.0
                lastgaelam = 0.0
            delta = updated[curr] + gamma * nextvalue - v[b][curr]
            lastgaelam = delta + gamma * lam * lastgaelam
            adv[b][curr] = lastgaelam
    return torch.tensor(adv)


def turn_ends_of(mask):
    """[B, T] bool: the last token of every reply segment (the next token is not sampled, or there is none)."""
    nxt = torch.cat([mask[:, 1:], torch.zeros(mask.shape[0], 1)], dim=1)
    return (mask > 0) & (nxt == 0)


def turn_rewards(ends, gen):
    """A non-zero reward on every turn end (RAGEN's loop needs them to find its turns), 0 elsewhere."""
    r = torch.randn(ends.shape, generator=gen)
    return torch.where(ends, r + torch.sign(r) * 0.5, 0.0)


@pytest.mark.parametrize("gamma,lam,hg", [(1.0, 1.0, 0.95), (0.9, 0.8, 0.7), (0.99, 0.0, 1.0), (1.0, 0.5, 0.0)])
def test_bi_level_gae_matches_ragen_loop(gamma, lam, hg):
    gen = torch.Generator().manual_seed(7)
    mask = multi_turn_mask(8, 32, gen, empty_rows=(2,))
    ends = turn_ends_of(mask)
    assert (ends.sum(dim=1) >= 2).sum() >= 5  # mostly multi-turn rows
    values = torch.randn(8, 32, generator=gen)
    rewards = turn_rewards(ends, gen)
    adv, ret = bi_level_gae(rewards, values, mask, ends, gamma, lam, hg)
    torch.testing.assert_close(adv, ragen_bi_level_gae(rewards, values, mask, gamma, lam, hg), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, adv + values)
    assert adv[2].abs().sum() == 0 and (adv[mask == 0] == 0).all()


def test_bi_level_gae_zero_reward_turn_is_its_own_turn():
    """Deviation 5: a turn end with reward 0 still ends its turn here; RAGEN merges that turn into the next."""
    gen = torch.Generator().manual_seed(8)
    mask = multi_turn_mask(6, 32, gen, empty_rows=())
    ends = turn_ends_of(mask)
    values = torch.randn(6, 32, generator=gen)
    rewards = turn_rewards(ends, gen)
    first_ends = [int(torch.nonzero(ends[b])[0]) for b in range(6)]
    for b in range(6):
        if ends[b].sum() >= 2:
            rewards[b, first_ends[b]] = 0.0  # the first turn earns nothing
    adv, _ = bi_level_gae(rewards, values, mask, ends, 0.9, 0.95, 0.8)
    eos = [torch.nonzero(ends[b]).flatten().tolist() for b in range(6)]
    torch.testing.assert_close(adv, ragen_bi_level_gae(rewards, values, mask, 0.9, 0.95, 0.8, eos=eos),
                               atol=1e-5, rtol=1e-5)
    merged = ragen_bi_level_gae(rewards, values, mask, 0.9, 0.95, 0.8)  # RAGEN as it runs
    assert not torch.allclose(adv, merged, atol=1e-3)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8), (0.99, 0.0)])
def test_bi_level_gae_with_one_turn_is_gae(gamma, lam):
    """One turn: the turn level has no next turn, so A[e] = r[e] - V[e] whatever high_level_gamma is; below e the
    token level is gae's recursion with that same last step. Any per-token rewards on the turn's tokens too."""
    gen = torch.Generator().manual_seed(9)
    B, T = 6, 20
    start = torch.randint(1, 6, (B,), generator=gen)
    stop = torch.randint(8, T + 1, (B,), generator=gen)
    pos = torch.arange(T)
    mask = ((pos >= start[:, None]) & (pos < stop[:, None])).float()  # one contiguous reply per row
    values = torch.randn(B, T, generator=gen)
    rewards = torch.randn(B, T, generator=gen) * mask
    want, _ = gae(rewards, values, mask, gamma, lam)
    for hg in (0.0, 0.5, 0.95):
        adv, _ = bi_level_gae(rewards, values, mask, turn_ends_of(mask), gamma, lam, hg)
        torch.testing.assert_close(adv, want, atol=1e-5, rtol=1e-5)


def test_bi_level_gae_undiscounted_with_turn_rewards_is_gae():
    """gamma = lam = high_level_gamma = 1 and rewards only on turn ends: both levels telescope to the rewards still
    to come minus V[t], which is what gae gives with gamma = lam = 1."""
    gen = torch.Generator().manual_seed(10)
    mask = multi_turn_mask(7, 30, gen)
    ends = turn_ends_of(mask)
    values = torch.randn(7, 30, generator=gen)
    rewards = turn_rewards(ends, gen)
    adv, _ = bi_level_gae(rewards, values, mask, ends, 1.0, 1.0, 1.0)
    torch.testing.assert_close(adv, gae(rewards, values, mask, 1.0, 1.0)[0], atol=1e-5, rtol=1e-5)
    # and the turn-level discount matters when it is not 1
    assert not torch.allclose(bi_level_gae(rewards, values, mask, ends, 1.0, 1.0, 0.5)[0], adv, atol=1e-3)


def test_bi_level_gae_by_hand():
    # RAGEN's own example (core_algos.py __main__), gamma = lam = 1, high_level_gamma = 0.95, whitening left out
    rewards = torch.tensor([[0, 0, 0, 0, 1, 0, 0, 0, 0, 1.0]])
    values = torch.tensor([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]])
    mask = torch.ones(1, 10)
    adv, ret = bi_level_gae(rewards, values, mask, rewards > 0, 1.0, 1.0, 0.95)
    a9 = 1 - 1.0  # last turn: r - V
    a4 = 1 + 0.95 * 1.0 - 0.5 + 0.95 * a9  # r + hg V[9] - V[4] + hg lam A[9]
    want = [a4 + 0.5 - v for v in (0.1, 0.2, 0.3, 0.4)] + [a4] + [a9 + 1.0 - v for v in (0.6, 0.7, 0.8, 0.9)] + [a9]
    torch.testing.assert_close(adv, torch.tensor([want]))
    torch.testing.assert_close(ret[0, 4], torch.tensor(a4 + 0.5))


def test_bi_level_gae_junk_outside_mask_and_bad_inputs():
    mask = torch.tensor([[0, 1, 1, 0, 1, 1, 0.0]])
    ends = torch.tensor([[0, 0, 1, 0, 0, 1, 0]]).bool()
    values = torch.tensor([[float("nan"), 0.1, 0.2, float("inf"), 0.3, 0.4, float("nan")]])
    rewards = torch.tensor([[0, 0, 1.0, 0, 0, 2.0, 0]])
    adv, _ = bi_level_gae(rewards, values, mask, ends, 0.9, 0.9, 0.9)
    assert torch.isfinite(adv).all() and (adv[mask == 0] == 0).all()
    with pytest.raises(ValueError, match="turn_ends marks a token outside mask"):
        bi_level_gae(rewards, values, mask, ends | torch.tensor([[1, 0, 0, 0, 0, 0, 0]]).bool(), 1, 1, 1)
    with pytest.raises(ValueError, match="last sampled token must be a turn end"):
        bi_level_gae(rewards, values, mask, torch.tensor([[0, 0, 1, 0, 0, 0, 0]]).bool(), 1, 1, 1)
    with pytest.raises(ValueError, match="shape"):
        bi_level_gae(rewards, values, mask, ends[:, :5], 1, 1, 1)
    with pytest.raises(ValueError, match="outside mask; rewards must sit"):
        bi_level_gae(rewards + torch.tensor([[0, 0, 0, 1.0, 0, 0, 0]]), values, mask, ends, 1, 1, 1)
