"""extras/rollout_correction.py (train.py --rollout-correction, beyond the paper) and extras/gspo.py
(--ratio-level sequence): each against a slow per-token / per-row loop, each equal to the plain loss where it
must be (rollout log-probs equal to the update's; every sequence ratio 1).

    python -m pytest -q tests/test_rollout_correction.py      (about 15 s on one core)
"""
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from extras import gspo, rollout_correction as rc  # noqa: E402
from starpo import Batch, policy_loss  # noqa: E402


def case(seed: int, B: int = 5, T: int = 9, spread: float = 0.8):
    g = torch.Generator().manual_seed(seed)
    mask = (torch.rand(B, T, generator=g) > 0.3).float()
    mask[0] = 0.0  # a row with nothing trained
    old = -torch.rand(B, T, generator=g) * 3
    rollout = old + torch.randn(B, T, generator=g) * spread
    rollout[1, :3] = math.nan  # tokens without a sampler's log-prob (a scripted reply)
    adv = torch.randn(B, T, generator=g)
    return old, rollout, mask, adv


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cap", [1.0, 1.5, 2.0, 10.0])
def test_tis_weights_equal_a_slow_loop(seed, cap):
    old, rollout, mask, _ = case(seed)
    w, m = rc.tis_weights(old, rollout, mask, cap)
    seen, truncated = [], 0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t] > 0 and math.isfinite(rollout[b, t].item()):
                rho = math.exp(old[b, t].item() - rollout[b, t].item())
                assert w[b, t].item() == pytest.approx(min(rho, cap), rel=1e-5)
                seen.append(min(rho, cap))
                truncated += rho > cap
            else:
                assert w[b, t].item() == 1.0
    assert m["train/is_weight_mean"] == pytest.approx(sum(seen) / len(seen), rel=1e-5)
    assert m["train/is_weight_max"] == pytest.approx(max(seen), rel=1e-5)
    assert m["train/is_truncated"] == pytest.approx(truncated / len(seen))


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cap", [1.01, 1.5, 4.0])
def test_geometric_mask_equals_a_slow_loop(seed, cap):
    old, rollout, mask, _ = case(seed, spread=0.3)
    keep, m = rc.geometric_keep(old, rollout, mask, cap)
    dropped = 0
    for b in range(mask.shape[0]):
        logs = [old[b, t].item() - rollout[b, t].item() for t in range(mask.shape[1])
                if mask[b, t] > 0 and math.isfinite(rollout[b, t].item())]
        if not logs:
            assert keep[b]
            continue
        geo = math.exp(sum(logs) / len(logs))
        assert bool(keep[b]) == (1 / cap <= geo <= cap), (b, geo)
        dropped += not (1 / cap <= geo <= cap)
    assert m["train/is_masked_rows"] == pytest.approx(dropped / mask.shape[0])


@pytest.mark.parametrize("mode", ["tis", "mask"])
def test_no_mismatch_is_the_plain_loss_exactly(mode):
    """Rollout log-probs equal to the update's: every weight 1 and no row masked, so the batch and the loss
    are exactly the plain ones."""
    old, _, mask, adv = case(7)
    logp = old + 0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(1))
    batch = Batch(input_ids=torch.zeros(mask.shape, dtype=torch.long), attention_mask=torch.ones_like(mask),
                  loss_mask=mask.clone(), advantages=adv.clone(), old_logp=old, rollout_logp=old.clone())
    rc.correct(batch, mode, 2.0)
    assert torch.equal(batch.advantages, adv) and torch.equal(batch.loss_mask, mask)
    assert torch.equal(policy_loss(logp, old, batch.advantages, batch.loss_mask)[0],
                       policy_loss(logp, old, adv, mask)[0])


def test_tis_weighted_loss_equals_the_weighted_per_token_loss():
    """verl weights the clipped per-token loss by w; weighting the advantage is the same (w >= 0)."""
    old, rollout, mask, adv = case(3)
    logp = old + 0.3 * torch.randn(old.shape, generator=torch.Generator().manual_seed(2))
    w, _ = rc.tis_weights(old, rollout, mask, 2.0)
    loss, _ = policy_loss(logp, old, adv * w, mask)
    total, count = 0.0, 0
    for b in range(mask.shape[0]):
        for t in range(mask.shape[1]):
            if mask[b, t] > 0:
                r = math.exp(logp[b, t].item() - old[b, t].item())
                a = adv[b, t].item()
                total += w[b, t].item() * max(-a * r, -a * min(max(r, 0.8), 1.28))
                count += 1
    assert loss.item() == pytest.approx(total / count, rel=1e-5)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gspo_loss_equals_a_slow_loop(seed, agg):
    old, _, mask, adv = case(seed)
    logp = old + 0.01 * torch.randn(old.shape, generator=torch.Generator().manual_seed(seed))
    loss, m = gspo.sequence_policy_loss(logp, old, adv, mask, 3e-4, 4e-4, agg)
    rows = []
    for b in range(mask.shape[0]):
        ts = [t for t in range(mask.shape[1]) if mask[b, t] > 0]
        if not ts:
            continue
        s = math.exp(sum(logp[b, t].item() - old[b, t].item() for t in ts) / len(ts))
        rows.append([max(-adv[b, t].item() * s, -adv[b, t].item() * min(max(s, 1 - 3e-4), 1 + 4e-4)) for t in ts])
    if agg == "token-mean":
        want = sum(sum(r) for r in rows) / sum(len(r) for r in rows)
    else:
        want = sum(sum(r) / len(r) for r in rows) / len(rows)
    assert loss.item() == pytest.approx(want, rel=1e-5, abs=1e-7)
    assert 0 <= m["pg_clipfrac"].item() <= 1


def test_gspo_at_ratio_one_is_the_token_loss():
    """Every sequence ratio 1 (logp = old): the same value as starpo.policy_loss, and for a row-constant
    advantage (GRPO's) the same gradient."""
    old, _, mask, _ = case(5)
    row_adv = torch.randn(mask.shape[0], 1, generator=torch.Generator().manual_seed(3)).expand_as(mask)
    grads = []
    for fn in (policy_loss, gspo.sequence_policy_loss):
        logp = old.clone().requires_grad_(True)
        loss, _ = fn(logp, old, row_adv, mask)
        loss.backward()
        grads.append((loss.detach(), logp.grad))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-7)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-7)


def test_train_runs_both_options_names_them_and_logs_the_weights(bandit_tiny, tmp_path):
    import json
    import train
    out = tmp_path / "run"
    train.main(["--env", "bandit", "--model", bandit_tiny, "--no-think", "--steps", "2", "--prompts", "4",
                "--rollouts", "4", "--filter", "1.0", "--eval-every", "0", "--eval-prompts", "2",
                "--rollout-correction", "tis", "--ratio-level", "sequence", "--out", str(out)])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "train/is_weight_mean" in r]
    assert trained and all(0.5 < r["train/is_weight_mean"] <= 2.0 for r in trained)
    first = json.loads((out / "config.json").read_text())
    assert first["rollout_correction"] == "tis" and first["ratio_level"] == "sequence"
