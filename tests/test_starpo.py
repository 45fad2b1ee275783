"""Tests for starpo.py: losses against slow loops, the fused log-prob/entropy path against the naive full-logits
path (values and gradients), and `update` on a tiny random Qwen2ForCausalLM built in-process.

Run from the repository root:  python -m pytest -q tests/test_starpo.py   (about 15 s on one core)
"""
import copy
import math
import sys
from pathlib import Path

import pytest
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import starpo  # noqa: E402
from engine import logprobs  # noqa: E402
from engine.logprobs import fused_logprobs_entropy, naive_logprobs_entropy  # noqa: E402
from starpo import token_logprobs  # noqa: E402
from starpo import Batch, UpdateConfig, aggregate, kl_penalty, policy_loss, update, value_loss  # noqa: E402

torch.set_num_threads(1)


def rel_err(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp(min=1e-30))


def multi_turn_mask(B, T, gen, lengths=None):
    """[B, T] loss mask with holes (env messages) between reply segments; row 1 has no sampled token."""
    mask = torch.zeros(B, T)
    for b in range(B):
        end = T if lengths is None else int(lengths[b])
        if b == 1:
            continue
        t, sampled = 2, True
        while t < end:
            seg = int(torch.randint(1, 4, (1,), generator=gen))
            if sampled:
                mask[b, t:min(t + seg, end)] = 1
            t += seg
            sampled = not sampled
    return mask


# --------------------------------------------------------------------------------------------------------
# policy loss, KL, value loss against loops
# --------------------------------------------------------------------------------------------------------

def slow_policy_loss(logp, old, adv, mask, cl, ch, agg):
    B, T = mask.shape
    tok = [[None] * T for _ in range(B)]
    n = up = lo = clipped = 0
    kl = 0.0
    for b in range(B):
        for t in range(T):
            if mask[b, t] != 1:
                continue
            lr = max(-20.0, min(20.0, float(logp[b, t]) - float(old[b, t])))
            r = math.exp(lr)
            a = float(adv[b, t])
            l1, l2 = -a * r, -a * min(max(r, 1 - cl), 1 + ch)
            loss = max(l1, l2)
            tok[b][t] = loss
            n += 1
            clipped += l2 > l1
            up += a > 0 and r > 1 + ch
            lo += a < 0 and r < 1 - cl
            kl += -lr
    rows = [[x for x in row if x is not None] for row in tok]
    if agg == "token-mean":
        value = sum(sum(r) for r in rows) / n
    elif agg == "seq-mean-token-mean":
        value = sum(sum(r) / len(r) for r in rows if r) / sum(1 for r in rows if r)
    else:
        value = sum(sum(r) for r in rows if r) / sum(1 for r in rows if r)
    return value, {"pg_clipfrac": clipped / n, "pg_clipfrac_upper": up / n, "pg_clipfrac_lower": lo / n,
                   "approx_kl": kl / n}


@pytest.mark.parametrize("agg", starpo.AGG_MODES)
def test_policy_loss_matches_loop(agg):
    gen = torch.Generator().manual_seed(0)
    B, T = 6, 14
    mask = multi_turn_mask(B, T, gen)
    old = torch.randn(B, T, generator=gen) - 2
    logp = old + torch.randn(B, T, generator=gen) * 0.5  # ratios spread across both clip bounds
    logp[0, 3] = old[0, 3] + 30  # exercises the +-20 log-ratio clamp
    adv = torch.randn(B, T, generator=gen)
    loss, metrics = policy_loss(logp, old, adv, mask, 0.2, 0.28, agg)
    want, want_m = slow_policy_loss(logp, old, adv, mask, 0.2, 0.28, agg)
    assert loss.item() == pytest.approx(want, rel=1e-5)
    for k, v in want_m.items():
        assert metrics[k].item() == pytest.approx(v, rel=1e-5, abs=1e-7), k


def test_policy_loss_at_ratio_one_is_minus_mean_advantage():
    gen = torch.Generator().manual_seed(1)
    mask = multi_turn_mask(5, 12, gen)
    logp = torch.randn(5, 12, generator=gen)
    adv = torch.randn(5, 12, generator=gen)
    loss, m = policy_loss(logp, logp.clone(), adv, mask)
    assert loss.item() == pytest.approx(-(adv * mask).sum().item() / mask.sum().item(), rel=1e-6)
    assert m["pg_clipfrac"].item() == 0 and m["approx_kl"].item() == 0


def test_clip_boundaries_on_both_sides_and_their_gradients():
    # one token per case: (advantage, ratio) -> is it clipped (zero gradient)?
    cases = [(1.0, 1.27, False), (1.0, 1.29, True),  # upper bound 1 + 0.28
             (1.0, 0.5, False),  # A > 0 below the lower bound: never clipped
             (-1.0, 0.81, False), (-1.0, 0.79, True),  # lower bound 1 - 0.2
             (-1.0, 1.5, False)]  # A < 0 above the upper bound: never clipped
    adv = torch.tensor([[a for a, _, _ in cases]])
    old = torch.zeros(1, len(cases))
    logp = torch.log(torch.tensor([[r for _, r, _ in cases]])).requires_grad_()
    mask = torch.ones(1, len(cases))
    loss, m = policy_loss(logp, old, adv, mask, 0.2, 0.28)
    loss.backward()
    for i, (_, _, is_clipped) in enumerate(cases):
        assert (logp.grad[0, i] == 0).item() == is_clipped, cases[i]
    assert m["pg_clipfrac_upper"].item() == pytest.approx(1 / 6)
    assert m["pg_clipfrac_lower"].item() == pytest.approx(1 / 6)
    assert m["pg_clipfrac"].item() == pytest.approx(2 / 6)


def test_junk_outside_the_mask_never_reaches_loss_or_gradient():
    mask = torch.tensor([[0, 1, 1, 0.0]])
    logp = torch.zeros(1, 4, requires_grad=True)
    adv = torch.tensor([[float("nan"), 1.0, -1.0, float("inf")]])
    old = torch.tensor([[float("inf"), 0.0, 0.0, float("nan")]])
    loss, _ = policy_loss(logp, old, adv, mask)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


def test_kl_estimators_match_formulas():
    gen = torch.Generator().manual_seed(2)
    logp = torch.randn(3, 7, generator=gen)
    ref = torch.randn(3, 7, generator=gen)
    ref[0, 0] = logp[0, 0] + 15  # k3 = e^15 - 16 -> clamped to 10
    k1, k3 = kl_penalty(logp, ref, "k1"), kl_penalty(logp, ref, "k3")
    for b in range(3):
        for t in range(7):
            d = float(ref[b, t] - logp[b, t])
            assert k1[b, t].item() == pytest.approx(-d, abs=1e-6)
            assert k3[b, t].item() == pytest.approx(min(10.0, math.exp(d) - d - 1), rel=1e-5, abs=1e-6)
    assert k3[0, 0].item() == 10.0 and (k3 >= 0).all()


def test_value_loss_matches_loop():
    gen = torch.Generator().manual_seed(3)
    mask = multi_turn_mask(4, 10, gen)
    values = torch.randn(4, 10, generator=gen)
    old = values + torch.randn(4, 10, generator=gen)  # some beyond the 0.5 clip
    ret = torch.randn(4, 10, generator=gen)
    loss, m = value_loss(values, old, ret, mask, clip=0.5)
    terms, clipped = [], 0
    for b in range(4):
        for t in range(10):
            if mask[b, t] == 1:
                v, o, r = float(values[b, t]), float(old[b, t]), float(ret[b, t])
                vc = o + max(-0.5, min(0.5, v - o))
                terms.append(max((v - r) ** 2, (vc - r) ** 2))
                clipped += (vc - r) ** 2 > (v - r) ** 2
    assert loss.item() == pytest.approx(0.5 * sum(terms) / len(terms), rel=1e-5)
    assert m["vf_clipfrac"].item() == pytest.approx(clipped / len(terms))


def test_aggregate_denominator_override_makes_micro_batches_add_up():
    gen = torch.Generator().manual_seed(4)
    mask = multi_turn_mask(6, 9, gen)
    x = torch.randn(6, 9, generator=gen)
    for agg in starpo.AGG_MODES:
        full = aggregate(x, mask, agg)
        count = mask.sum() if agg == "token-mean" else (mask.sum(1) > 0).sum()
        parts = sum(aggregate(x[i:i + 2], mask[i:i + 2], agg, denom=count) for i in range(0, 6, 2))
        assert parts.item() == pytest.approx(full.item(), rel=1e-6)


# --------------------------------------------------------------------------------------------------------
# fused path against the naive full-logits path
# --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("with_bias,temperature,chunk,block", [
    (False, 1.0, 128, None),  # several chunks, the last one partial
    (True, 0.7, 1000, None),  # one chunk
    (False, 0.5, 96, 32 * 32768),  # row blocks of 32 inside each chunk
])
def test_fused_matches_naive_values_and_grads(with_bias, temperature, chunk, block, monkeypatch):
    if block is not None:
        monkeypatch.setattr(logprobs, "_BLOCK_ELEMENTS", block)
    gen = torch.Generator().manual_seed(5)
    N, H, V = 300, 48, 32768
    hidden = torch.randn(N, H, generator=gen).requires_grad_()
    weight = (torch.randn(V, H, generator=gen) * 0.4).requires_grad_()  # logits std ~ 2.8
    bias = (torch.randn(V, generator=gen) * 0.5).requires_grad_() if with_bias else None
    targets = torch.randint(0, V, (N,), generator=gen)
    g_lp, g_ent = torch.randn(N, generator=gen), torch.randn(N, generator=gen)
    params = [p for p in (hidden, weight, bias) if p is not None]

    def run(fn, *extra):
        for p in params:
            p.grad = None
        lp, ent = fn(hidden, weight, bias, targets, temperature, *extra)
        ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
        return [lp.detach(), ent.detach()] + [p.grad.clone() for p in params]

    fused, naive = run(fused_logprobs_entropy, chunk), run(naive_logprobs_entropy)
    for name, a, b in zip(["logp", "entropy", "grad hidden", "grad weight", "grad bias"], fused, naive):
        assert rel_err(a, b) < 1e-5, (name, rel_err(a, b))


def tiny_qwen(seed=0, vocab=96):
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, intermediate_size=64, tie_word_embeddings=True)
    return transformers.Qwen2ForCausalLM(cfg)


def test_token_logprobs_alignment_and_fused_equals_naive_on_a_model():
    model = tiny_qwen()
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, 96, (3, 11), generator=gen)
    attn = torch.ones_like(ids)
    attn[2, 8:] = 0
    lp_f, ent_f = token_logprobs(model, ids, attn, temperature=0.7, fused=True, chunk_size=7)
    grads_f = torch.autograd.grad((lp_f.sum() + ent_f.sum()), list(model.parameters()))
    lp_n, ent_n = token_logprobs(model, ids, attn, temperature=0.7, fused=False)
    grads_n = torch.autograd.grad((lp_n.sum() + ent_n.sum()), list(model.parameters()))
    assert (lp_f[:, 0] == 0).all() and (ent_f[:, 0] == 0).all()
    assert rel_err(lp_f, lp_n) < 1e-5 and rel_err(ent_f, ent_n) < 1e-5
    for gf, gn in zip(grads_f, grads_n):
        assert rel_err(gf, gn) < 1e-5
    # position t is scored by the logits at t - 1, at the given temperature
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn).logits
    for b, t in [(0, 1), (1, 5), (2, 7)]:
        want = torch.log_softmax(logits[b, t - 1] / 0.7, -1)
        assert lp_f[b, t].item() == pytest.approx(want[ids[b, t]].item(), abs=1e-5)
        assert ent_f[b, t].item() == pytest.approx(-(want.exp() * want).sum().item(), abs=1e-5)


def test_shared_prefix_len_is_the_common_start_and_leaves_a_token():
    assert logprobs.shared_prefix_len([[1, 2, 3, 4], [1, 2, 5], [1, 2, 3]]) == 2
    assert logprobs.shared_prefix_len([[7, 8, 9], [7, 8, 9]]) == 2  # identical rows still keep 1 token after it
    assert logprobs.shared_prefix_len([[1, 2], [3, 2]]) == 0
    assert logprobs.shared_prefix_len([[5, 6, 7]]) == 2 and logprobs.shared_prefix_len([]) == 0


def shared_prefix_batch(gen, B=4, P=9, T=16):
    """[B, T] ids whose rows share their first P tokens, and an attention mask with two right-padded rows."""
    ids = torch.cat([torch.randint(0, 96, (1, P), generator=gen).expand(B, -1),
                     torch.randint(0, 96, (B, T - P), generator=gen)], dim=1)
    attn = torch.ones_like(ids)
    attn[1, 13:] = 0
    attn[3, 10:] = 0
    return ids, attn


def test_shared_prefix_path_equals_the_plain_path_values_and_grads():
    """The prefix run once and repeated must give every row the log-probs and the summed gradients of the
    plain batched path, with right padding on rows of different lengths."""
    model = tiny_qwen()
    gen = torch.Generator().manual_seed(8)
    B, P, T = 4, 9, 16
    ids, attn = shared_prefix_batch(gen, B, P, T)
    assert logprobs.shared_prefix_len(ids.tolist()) >= P
    w = torch.randn(B, T, generator=gen) * attn
    out = {}
    for pl in (0, P):
        lp, ent = token_logprobs(model, ids, attn, temperature=0.9, fused=True, chunk_size=5, prefix_len=pl)
        grads = torch.autograd.grad((lp * w).sum() + (ent * attn).sum(), list(model.parameters()))
        out[pl] = (lp * attn, ent * attn, grads)
    assert rel_err(out[P][0], out[0][0]) < 1e-5 and rel_err(out[P][1], out[0][1]) < 1e-5
    for gp, g0 in zip(out[P][2], out[0][2]):
        assert rel_err(gp, g0) < 1e-5


@pytest.mark.parametrize("prefix_len", [0, 9])
def test_positions_run_the_head_only_there_and_match_the_full_path(prefix_len):
    """`positions` (a loss mask): on its tokens the values and the gradients of a loss read there are those of
    the full path (fused, shared prefix or not, and naive); everywhere else both outputs are exactly 0."""
    model = tiny_qwen()
    gen = torch.Generator().manual_seed(9)
    B, P, T = 4, 9, 16
    ids, attn = shared_prefix_batch(gen, B, P, T)
    pos = multi_turn_mask(B, T, gen) * attn  # holes, padding, and a row with no position at all
    w = torch.randn(B, T, generator=gen)
    ref_lp, ref_ent = token_logprobs(model, ids, attn, 0.8, fused=True, chunk_size=5)
    ref = torch.autograd.grad(((ref_lp * w + ref_ent) * pos).sum(), list(model.parameters()))
    for fused in (True, False):
        lp, ent = token_logprobs(model, ids, attn, 0.8, fused=fused, chunk_size=5,
                                 prefix_len=prefix_len if fused else 0, positions=pos.bool())
        assert (lp[pos == 0] == 0).all() and (ent[pos == 0] == 0).all()
        assert rel_err(lp * pos, ref_lp * pos) < 1e-5 and rel_err(ent * pos, ref_ent * pos) < 1e-5
        grads = torch.autograd.grad(((lp * w + ent) * pos).sum(), list(model.parameters()))
        for g, r in zip(grads, ref):
            assert rel_err(g, r) < 1e-5


# --------------------------------------------------------------------------------------------------------
# update() on a tiny Qwen2
# --------------------------------------------------------------------------------------------------------

class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients it was asked to apply."""

    def __init__(self, params, lr):
        super().__init__(params, lr=lr)
        self.seen = []

    def step(self, closure=None):
        self.seen.append([p.grad.clone() for g in self.param_groups for p in g["params"]])
        return super().step(closure)


class TinyCritic(torch.nn.Module):
    """values[:, t] = value of the state before token t, from a tiny Qwen2 body and a scalar head."""

    def __init__(self):
        super().__init__()
        self.body = tiny_qwen(seed=1).model
        self.head = torch.nn.Linear(32, 1)

    def forward(self, input_ids, attention_mask):
        h = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
        return torch.nn.functional.pad(self.head(h[:, :-1]).squeeze(-1), (1, 0))  # aligned like logp


def make_batch(model, B=8, T=20, seed=7, with_ref=False, with_critic=None):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 96, (B, T), generator=gen)
    lengths = torch.randint(T - 6, T + 1, (B,), generator=gen)
    attn = (torch.arange(T)[None, :] < lengths[:, None]).long()
    loss_mask = multi_turn_mask(B, T, gen, lengths)
    with torch.no_grad():
        old_logp, _ = token_logprobs(model, ids, attn)
    adv = torch.randn(B, 1, generator=gen) * loss_mask
    extra = {}
    if with_ref:
        extra["ref_logp"] = old_logp + 0.3 * torch.randn(B, T, generator=gen)
    if with_critic is not None:
        with torch.no_grad():
            extra["old_values"] = with_critic(ids, attn)
        extra["returns"] = extra["old_values"] + torch.randn(B, T, generator=gen)
    return Batch(ids, attn, loss_mask, adv, old_logp, **extra)


def test_first_update_on_fresh_rollouts_has_ratio_exactly_one():
    model = tiny_qwen()
    batch = make_batch(model)
    cfg = UpdateConfig(mini_batch=8, micro_batch=4, entropy_coef=0.0)
    out = update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch, cfg,
                 generator=torch.Generator().manual_seed(0))
    assert out["train/pg_clipfrac"] == 0.0 and out["train/approx_kl"] == 0.0
    m = batch.loss_mask
    assert out["train/pg_loss"] == pytest.approx(-(batch.advantages * m).sum().item() / m.sum().item(), rel=1e-5)
    assert out["train/optimizer_steps"] == 1 and out["train/skipped_nonfinite"] == 0
    assert set(out) == {"train/pg_loss", "train/entropy", "train/grad_norm", "train/pg_clipfrac",
                        "train/pg_clipfrac_upper", "train/pg_clipfrac_lower", "train/approx_kl",
                        "train/skipped_nonfinite", "train/optimizer_steps"}


def test_without_old_logp_one_step_equals_the_separate_old_logp_pass():
    """A batch that is one optimizer step on fresh rollouts needs no old-log-prob pass: update() takes them from
    its own forward, detached. Same weights, same metrics; a batch of two mini-batches is refused."""
    import dataclasses
    results = []
    for old in (True, False):
        model = tiny_qwen()
        batch = make_batch(model, with_ref=True)
        if not old:
            batch = dataclasses.replace(batch, old_logp=None)
        out = update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch,
                     UpdateConfig(mini_batch=8, micro_batch=3), generator=torch.Generator().manual_seed(0))
        results.append((out, torch.cat([p.detach().flatten() for p in model.parameters()])))
    (a, wa), (b, wb) = results
    assert torch.allclose(wa, wb, atol=1e-6, rtol=0)
    for k, v in a.items():
        assert b[k] == pytest.approx(v, rel=1e-4, abs=1e-6), k
    with pytest.raises(ValueError, match="one mini-batch"):
        update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), dataclasses.replace(batch, old_logp=None),
               UpdateConfig(mini_batch=4), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_gradient_accumulation_equals_one_big_micro_batch(agg):
    base, critic0 = tiny_qwen(), TinyCritic()
    batch = make_batch(base, with_ref=True, with_critic=critic0)
    grads, weights = [], []
    for micro in (8, 3, 1):
        model, critic = copy.deepcopy(base), copy.deepcopy(critic0)
        opt, copt = RecordingSGD(model.parameters(), lr=0.1), RecordingSGD(critic.parameters(), lr=0.1)
        cfg = UpdateConfig(mini_batch=8, micro_batch=micro, agg=agg, kl_coef=0.01, max_grad_norm=1e9)
        update(model, opt, batch, cfg, critic=critic, critic_optimizer=copt,
               generator=torch.Generator().manual_seed(0))
        grads.append(opt.seen[0] + copt.seen[0])
        weights.append([p.detach().clone() for p in list(model.parameters()) + list(critic.parameters())])
    for other in (1, 2):
        for a, b in zip(grads[0], grads[other]):
            torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-7)
        for a, b in zip(weights[0], weights[other]):
            torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_nonfinite_advantage_skips_the_step_and_leaves_weights_unchanged():
    model = tiny_qwen()
    batch = make_batch(model)
    batch.advantages[0, batch.loss_mask[0].nonzero()[0, 0]] = float("nan")
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    out = update(model, opt, batch, UpdateConfig(mini_batch=8, micro_batch=4))
    assert out["train/skipped_nonfinite"] == 1 and out["train/optimizer_steps"] == 0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters()) and len(opt.state) == 0
    # two mini-batches: the one holding the NaN row is skipped, the other is applied, weights stay finite
    batch.advantages[0] = float("inf") * batch.loss_mask[0].clamp(min=0)
    out = update(model, opt, batch, UpdateConfig(mini_batch=4, micro_batch=2),
                 generator=torch.Generator().manual_seed(1))
    assert out["train/skipped_nonfinite"] == 1 and out["train/optimizer_steps"] == 1
    assert math.isfinite(out["train/pg_loss"]) and math.isfinite(out["train/grad_norm"])
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_kl_to_init_is_measured_with_kl_coef_zero_and_does_not_enter_the_loss():
    base = tiny_qwen()
    batch = make_batch(base, with_ref=True)
    grads = []
    for ref in (batch.ref_logp, None):
        model = copy.deepcopy(base)
        opt = RecordingSGD(model.parameters(), lr=0.1)
        b = Batch(**{**batch.__dict__, "ref_logp": ref})
        out = update(model, opt, b, UpdateConfig(mini_batch=8, micro_batch=4, kl_coef=0.0),
                     generator=torch.Generator().manual_seed(0))
        grads.append(opt.seen[0])
        if ref is not None:
            want = (kl_penalty(batch.old_logp, ref, "k3") * batch.loss_mask).sum() / batch.loss_mask.sum()
            assert out["train/kl_to_init"] == pytest.approx(want.item(), rel=1e-5)
            assert out["train/kl_to_init"] > 0 and out["train/kl_loss"] > 0
        else:
            assert "train/kl_to_init" not in out
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_update_with_critic_reports_value_metrics_and_trains_it():
    model, critic = tiny_qwen(), TinyCritic()
    batch = make_batch(model, with_critic=critic)
    before = [p.detach().clone() for p in critic.parameters()]
    out = update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch,
                 UpdateConfig(mini_batch=4, micro_batch=2), critic=critic,
                 critic_optimizer=torch.optim.AdamW(critic.parameters(), lr=1e-3))
    for k in ("train/value_loss", "train/vf_clipfrac", "train/critic_grad_norm"):
        assert math.isfinite(out[k]), k
    assert out["train/vf_clipfrac"] == 0.0  # first pass: values == old_values, nothing clipped
    assert out["train/optimizer_steps"] == 2
    assert any(not torch.equal(a, b) for a, b in zip(before, critic.parameters()))


def test_bad_inputs_raise():
    model = tiny_qwen()
    batch = make_batch(model, B=2)
    with pytest.raises(ValueError, match="returns"):
        update(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, UpdateConfig(), critic=TinyCritic(),
               critic_optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bf16_autocast_fused_matches_fp32_and_update_runs():
    model = tiny_qwen().cuda()
    batch = make_batch(model.cpu(), B=4).to("cuda")
    model.cuda()
    with torch.no_grad():
        lp32, ent32 = token_logprobs(model, batch.input_ids, batch.attention_mask, fused=False)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            lp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, fused=True)
    assert lp.dtype == torch.float32 and ent.dtype == torch.float32
    assert (lp - lp32).abs().max().item() < 0.2  # bf16 body, fp32 head
    # the fused core alone, with bf16 inputs under autocast, equals fp32 on the same (rounded) inputs
    h = torch.randn(300, 64, device="cuda").bfloat16()
    w = torch.randn(32768, 64, device="cuda") * 0.3
    t = torch.randint(0, 32768, (300,), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        a = fused_logprobs_entropy(h, w, None, t, 1.0, 128)
    b = naive_logprobs_entropy(h.float(), w, None, t)  # fp32 (TF32 is off by default for matmuls)
    assert rel_err(a[0], b[0]) < 1e-4 and rel_err(a[1], b[1]) < 1e-4
    out = update(model, torch.optim.AdamW(model.parameters(), lr=1e-3), batch, UpdateConfig(mini_batch=4),
                 autocast_dtype=torch.bfloat16)
    assert out["train/optimizer_steps"] == 1


# --------------------------------------------------------------------------------------------------------
# dual clip against verl's compute_policy_loss (clip_ratio_c)
# --------------------------------------------------------------------------------------------------------

def verl_compute_policy_loss(old_log_prob, log_prob, advantages, response_mask, cliprange_low, cliprange_high,
                             clip_ratio_c):
    """verl/trainer/ppo/core_algos.py compute_policy_loss (RAGEN's pinned verl), line by line; the loss is
    returned per token ([B, T] pg_losses) so that any aggregation can be applied to it."""
    def masked_mean(x, mask):
        return (x * mask).sum() / mask.sum()
    assert clip_ratio_c > 1.0
    negative_approx_kl = log_prob - old_log_prob
    negative_approx_kl = torch.clamp(negative_approx_kl, min=-20.0, max=20.0)
    ratio = torch.exp(negative_approx_kl)
    ppo_kl = masked_mean(-negative_approx_kl, response_mask)
    pg_losses1 = -advantages * ratio
    pg_losses2 = -advantages * torch.clamp(ratio, 1 - cliprange_low, 1 + cliprange_high)
    clip_pg_losses1 = torch.maximum(pg_losses1, pg_losses2)
    pg_clipfrac = masked_mean(torch.gt(pg_losses2, pg_losses1).float(), response_mask)
    pg_losses3 = -advantages * clip_ratio_c
    clip_pg_losses2 = torch.min(pg_losses3, clip_pg_losses1)
    pg_clipfrac_lower = masked_mean(torch.gt(clip_pg_losses1, pg_losses3) * (advantages < 0).float(), response_mask)
    pg_losses = torch.where(advantages < 0, clip_pg_losses2, clip_pg_losses1)
    return pg_losses, pg_clipfrac, ppo_kl, pg_clipfrac_lower


@pytest.mark.parametrize("agg", starpo.AGG_MODES)
@pytest.mark.parametrize("c", [1.5, 3.0])
def test_dual_clip_matches_verl_compute_policy_loss(agg, c):
    gen = torch.Generator().manual_seed(11)
    B, T = 6, 16
    mask = multi_turn_mask(B, T, gen)
    old = torch.randn(B, T, generator=gen) - 2
    logp = (old + torch.randn(B, T, generator=gen) * 1.5).requires_grad_()  # ratios up to ~e^4, beyond c
    adv = torch.randn(B, T, generator=gen)
    loss, m = policy_loss(logp, old, adv, mask, 0.2, 0.28, agg, dual_clip=c)
    (grad,) = torch.autograd.grad(loss, logp)
    logp2 = logp.detach().clone().requires_grad_()
    tok, clipfrac, kl, lower = verl_compute_policy_loss(old, logp2, adv, mask, 0.2, 0.28, c)
    want = aggregate(tok, mask, agg)
    (want_grad,) = torch.autograd.grad(want, logp2)
    assert lower.item() > 0  # the cap bites somewhere
    assert loss.item() == pytest.approx(want.item(), rel=1e-6)
    torch.testing.assert_close(grad, want_grad)
    assert m["pg_clipfrac_dual"].item() == pytest.approx(lower.item())
    assert m["pg_clipfrac"].item() == pytest.approx(clipfrac.item())  # unchanged by the dual clip, as verl's
    assert m["approx_kl"].item() == pytest.approx(kl.item(), rel=1e-6)
    # the paper's metrics are the same with and without the dual clip; only the loss moves
    _, off = policy_loss(logp, old, adv, mask, 0.2, 0.28, agg)
    for k in ("pg_clipfrac", "pg_clipfrac_upper", "pg_clipfrac_lower", "approx_kl"):
        assert m[k].item() == off[k].item(), k
    assert off["pg_clipfrac_dual"].item() == 0


def test_dual_clip_by_hand():
    # (advantage, ratio): with c = 3 the loss of A < 0 is min(max(-A r, -A clip(r)), -A c)
    cases = [(-1.0, 5.0, 3.0, True),  # capped at -A c = 3: no gradient
             (-1.0, 2.0, 2.0, False),  # below the cap
             (-1.0, 0.5, 0.8, False),  # ordinary clip at 1 - eps_low: loss 0.8, no gradient either
             (2.0, 5.0, -2 * 1.28, False)]  # A > 0: the dual clip never applies
    adv = torch.tensor([[a for a, _, _, _ in cases]])
    logp = torch.log(torch.tensor([[r for _, r, _, _ in cases]])).requires_grad_()
    mask = torch.ones(1, len(cases))
    loss, m = policy_loss(logp, torch.zeros(1, len(cases)), adv, mask, 0.2, 0.28, dual_clip=3.0)
    assert loss.item() == pytest.approx(sum(w for _, _, w, _ in cases) / len(cases), rel=1e-6)
    loss.backward()
    assert logp.grad[0, 0] == 0 and logp.grad[0, 1] != 0
    assert m["pg_clipfrac_dual"].item() == pytest.approx(1 / 4)
    # off (None or 0) is the paper's loss: the first token then costs 5
    for off in (None, 0, 0.0):
        assert policy_loss(logp, torch.zeros(1, 4), adv, mask, 0.2, 0.28, dual_clip=off)[0].item() == \
            pytest.approx((5.0 + 2.0 + 0.8 - 2.56) / 4, rel=1e-6)


@pytest.mark.parametrize("c", [0.5, 1.0, -3.0, float("nan")])
def test_dual_clip_at_most_one_raises_one_line(c):
    x = torch.zeros(1, 3)
    with pytest.raises(ValueError, match=r"dual_clip must be > 1 \(verl's clip_ratio_c; 0 or None = off\)") as err:
        policy_loss(x, x, x, torch.ones(1, 3), dual_clip=c)
    assert "\n" not in str(err.value)
    model = tiny_qwen()
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        update(model, torch.optim.SGD(model.parameters(), lr=0.1), make_batch(model, B=2), UpdateConfig(dual_clip=c))


def test_update_with_dual_clip_logs_its_fraction_and_changes_the_step():
    base = tiny_qwen()
    batch = make_batch(base)
    # old policy far more likely on some tokens with A < 0: ratios e^2 = 7.4 > c = 3 there
    batch.advantages = -batch.advantages.abs()
    batch.old_logp = batch.old_logp - 2.0 * (torch.arange(batch.old_logp.shape[1]) % 3 == 0)
    outs, grads = [], []
    for c in (None, 3.0):
        model = copy.deepcopy(base)
        opt = RecordingSGD(model.parameters(), lr=0.1)
        cfg = UpdateConfig(mini_batch=8, micro_batch=4, dual_clip=c, entropy_coef=0.0)
        outs.append(update(model, opt, batch, cfg, generator=torch.Generator().manual_seed(0)))
        grads.append(opt.seen[0])
    off, on = outs
    assert "train/pg_clipfrac_dual" not in off
    assert set(on) == set(off) | {"train/pg_clipfrac_dual"}
    with torch.no_grad():
        logp, _ = token_logprobs(base, batch.input_ids, batch.attention_mask)
    _, m = policy_loss(logp, batch.old_logp, batch.advantages, batch.loss_mask, dual_clip=3.0)
    assert on["train/pg_clipfrac_dual"] == pytest.approx(m["pg_clipfrac_dual"].item(), rel=1e-5)
    assert on["train/pg_clipfrac_dual"] > 0.1
    assert on["train/pg_loss"] < off["train/pg_loss"]  # the capped tokens cost less
    for k in ("train/pg_clipfrac", "train/pg_clipfrac_lower", "train/approx_kl"):
        assert on[k] == pytest.approx(off[k]), k
    assert any(not torch.equal(a, b) for a, b in zip(*grads))
