"""StarPO's update: the clipped token-level policy loss, entropy bonus, KL to the initial policy, the PPO
critic's clipped value loss, a memory-light fused log-prob/entropy path, and `update` that runs them.

Paper: RAGEN section 2.2 (StarPO: PPO or GRPO on whole multi-turn trajectories, token-level objective),
section 4.2 (StarPO-S: KL removal, Clip-Higher eps_low = 0.2 / eps_high = 0.28), Appendix A (PPO critic),
Appendix C.2 (entropy bonus 0.001, KL 0.001 for StarPO and only tracked post-hoc for StarPO-S, gamma = lambda = 1,
"update batch 32, mini-batch 4", read as RAGEN's config does: 32 trajectories per optimizer step
(ppo_mini_batch_size), gradients accumulated over micro-batches of 4), Appendix D (clip and KL ablations).

Per sampled token t of a trajectory (mask[:, t] == 1):
    ratio_t = exp(logp_t - old_logp_t)                                   (log-ratio clamped to +-20)
    pg_t    = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high))
              and, with dual clip c > 1 (verl's clip_ratio_c, off by default), min(pg_t, -A_t * c) where A_t < 0
    loss    = agg(pg) - entropy_coef * agg(entropy) + kl_coef * agg(kl(logp, ref_logp))
where agg is a token mean over the mini-batch's sampled tokens (default). Log-probs and entropies come from
`token_logprobs`; the default fused path never materialises the [B, T, V] logits (V = 151,936 for Qwen2.5).

Token convention: `logp[:, t] = log p(input_ids[:, t] | input_ids[:, :t])` (from the logits at t - 1; column 0
is 0), `entropy[:, t]` the entropy of that same distribution, `values[:, t]` the value of the state just before
token t; all right-padded [B, T] like the masks.

Deliberate deviations from the paper / RAGEN (verl core_algos):
1. `pg_clipfrac_upper` counts tokens clipped at 1 + eps_high (A > 0), `pg_clipfrac_lower` those at 1 - eps_low
   (A < 0); verl's `pg_clipfrac_lower` is its dual-clip fraction, here `pg_clipfrac_dual` (logged by `update`
   only with dual clip on). Dual clip (`dual_clip=c`, verl's clip_ratio_c, RAGEN's current runs: 3.0) is off by
   default, as in the paper; verl always applies it (its assert c > 1 makes "off" impossible there).
2. The loss is aggregated over the whole mini-batch (`--loss-agg`), so micro-batching changes nothing (paper-era
   verl averaged per-micro-batch token means); `seq-mean-*` divide by the rows with a sampled token (verl: all).
3. Values outside the mask never reach a loss or a gradient (verl multiplies by the mask: NaN x 0 = NaN).
4. The fused path computes logits in fp32, also under bf16 autocast (HF and verl: a bf16 head); it assumes
   logits = lm_head(last hidden state) (Qwen2/Llama/Mistral); others must use `fused=False`.
5. `update` syncs with the host once per optimizer step (is the step finite?) and once for the metrics. A
   non-finite loss or grad norm skips the whole mini-batch, counted in `train/skipped_nonfinite`.
6. `train/approx_kl` is verl's `ppo_kl` (k1 to the rollout policy); `train/kl_to_init` uses `kl_kind` and is
   measured whenever reference log-probs are given, also with kl_coef = 0 (StarPO-S, Appendix C.2).
7. `update` leaves train/eval mode to the caller (old_logp must come from the same mode; Qwen2 has no dropout).
8. Data parallel (`update(shard=(rank, world))`): each rank trains rows rank, rank + world, ... of every mini-batch
   under DDP, the same gradient and metrics up to summation order; a rank short of rows runs a zero-weight one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOG_RATIO_CLAMP = 20.0


# --------------------------------------------------------------------------------------------------------- Aggregation

def aggregate(loss_tok: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
              denom: torch.Tensor | float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] over the sampled tokens to a scalar.

    token-mean:           sum over sampled tokens / number of sampled tokens
    seq-mean-token-mean:  per row, mean over its sampled tokens; then sum over rows / number of non-empty rows
    seq-mean-token-sum:   per row, sum over its sampled tokens; then sum over rows / number of non-empty rows
    `denom` overrides the divisor (tokens for token-mean, rows for seq-mean-*): `update` passes the count of the
    whole mini-batch so that micro-batch losses add up exactly to the mini-batch loss.
    """
    m = mask > 0
    masked = torch.where(m, loss_tok, 0.0)  # [B, T]
    if agg == "token-mean":
        total, count = masked.sum(), m.sum()
    else:
        row_tokens, row = m.sum(dim=1), masked.sum(dim=1)  # [B], [B]
        if agg == "seq-mean-token-mean":
            row = row / row_tokens.clamp(min=1)
        total, count = row.sum(), (row_tokens > 0).sum()
    return total / (count.clamp(min=1) if denom is None else denom)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over the tokens where mask == 1 (0 when there are none). No host sync."""
    m = mask > 0
    return torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1)


# -------------------------------------------------------------------------------------------------------------- Losses

def check_dual_clip(dual_clip: float | None) -> None:
    """0 or None turns dual clip off; otherwise it must exceed 1, as verl asserts for clip_ratio_c."""
    if dual_clip and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (verl's clip_ratio_c; 0 or None = off), got {dual_clip}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.28, agg: str = "token-mean",
                denom: torch.Tensor | float | None = None,
                dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with decoupled clip bounds (Clip-Higher, section 4.2): pg_t of the module docstring
    on [B, T] inputs, aggregated (`denom`: see `aggregate`). `dual_clip=c > 1` caps the loss of a token with A < 0
    at -A * c (verl's dual-clip PPO, clip_ratio_c), so a huge ratio on a bad action cannot dominate the batch;
    0 or None: off. Returns (loss, metrics), metrics as 0-dim tensors (token means over the mask, no host sync):
    pg_clipfrac(_upper, _lower), pg_clipfrac_dual (tokens where the cap bites: 0 when off), approx_kl (k1 to the
    old policy)."""
    check_dual_clip(dual_clip)
    m = mask > 0
    # outside the mask: A = 0 and old = logp, so junk there (padding) cannot reach a gradient
    adv = torch.where(m, advantages.float(), 0.0)
    old = torch.where(m, old_logp.float(), logp.detach().float())
    log_ratio = (logp.float() - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(unclipped, clipped)  # [B, T]
    dual = torch.zeros_like(m)  # [B, T] where the dual clip's cap is the loss
    if dual_clip:
        cap = -adv * dual_clip  # [B, T]
        dual = (adv < 0) & (loss_tok > cap)  # verl's pg_clipfrac_lower condition
        loss_tok = torch.where(adv < 0, torch.minimum(cap, loss_tok), loss_tok)
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), mask),
        "pg_clipfrac_upper": masked_mean(((adv > 0) & (ratio > 1.0 + clip_high)).float(), mask),
        "pg_clipfrac_lower": masked_mean(((adv < 0) & (ratio < 1.0 - clip_low)).float(), mask),
        "pg_clipfrac_dual": masked_mean(dual.float(), mask),
        "approx_kl": masked_mean(-log_ratio.detach(), mask),
    }
    return aggregate(loss_tok, mask, agg, denom), metrics


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate [B, T] of KL(pi || pi_ref) from samples of pi (Schulman's estimators).

    k1: logp - ref_logp (unbiased, high variance, can be negative).
    k3: r - log r - 1 with r = pi_ref / pi, i.e. verl's `low_var_kl` (log r clamped to +-20, result clamped to
        [-10, 10]); non-negative, low variance.
    """
    if kind == "k1":
        return logp.float() - ref_logp.float()
    log_r = (ref_logp.float() - logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.5,
               denom: torch.Tensor | float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (Appendix A): 0.5 * token-mean of max((V - R)^2, (V_clip - R)^2) where
    V_clip = old_V + clip(V - old_V, -clip, clip). Returns (loss, {"vf_clipfrac": fraction of tokens where the
    clipped error is the larger one}). `denom`: number of tokens to divide by (see `aggregate`).
    """
    m = mask > 0
    v = values.float()
    ret = torch.where(m, returns.float(), v.detach())
    old = torch.where(m, old_values.float(), v.detach())
    err = (v - ret) ** 2
    # clamp v itself into [old - clip, old + clip]: exact when inside (old + (v - old) may round off by an ulp and
    # count as "clipped")
    err_clipped = (torch.minimum(torch.maximum(v, old - clip), old + clip) - ret) ** 2
    frac = masked_mean((err_clipped > err).float(), mask)
    return 0.5 * aggregate(torch.maximum(err, err_clipped), mask, "token-mean", denom), {"vf_clipfrac": frac}


# ----------------------------------------------------- Log-probs and entropies: naive reference and fused chunked path

def naive_logprobs_entropy_from_logits(logits: torch.Tensor, targets: torch.Tensor,
                                       temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: logits [N, V] -> (log p(target) [N], entropy [N]) through the full fp32 log-softmax."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)  # [N, V]
    return logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def naive_logprobs_entropy(hidden, weight, bias, targets, temperature: float = 1.0):
    """Reference for `fused_logprobs_entropy`, same arguments: materialises the whole [N, V] fp32 logits."""
    logits = F.linear(hidden.float(), weight.float(), None if bias is None else bias.float())  # [N, V]
    return naive_logprobs_entropy_from_logits(logits, targets, temperature)


# Elementwise work on a chunk's logits runs over row blocks of about this many floats (64 MiB), so that the
# chunk's [c, V] logits buffer is the only large tensor; the matmuls still see the whole chunk.
_BLOCK_ELEMENTS = 1 << 24


def _chunk_logits(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, temperature: float,
                  out: torch.Tensor) -> torch.Tensor:
    """(h @ w.T + b) / temperature in fp32, written into `out` [c, V] (reused across chunks: no fresh
    allocation, and on CPU no page faults, per chunk)."""
    if b is None:
        torch.mm(h.float(), w.t(), out=out)
    else:
        torch.addmm(b, h.float(), w.t(), out=out)
    if temperature != 1.0:
        out.div_(temperature)
    return out


class _FusedLogprobEntropy(torch.autograd.Function):
    """`fused_logprobs_entropy`. Extra memory: one [chunk, V] fp32 logits buffer, one [rows, V] block buffer
    (64 MiB) and, in backward, the fp32 [V, H] weight gradient, instead of several [N, V] tensors."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size):
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            w = weight.float()  # no copy when the head is already fp32
            b = None if bias is None else bias.float()
            n, V = hidden.shape[0], w.shape[0]
            rows = max(1, min(chunk_size, _BLOCK_ELEMENTS // V))
            logits = torch.empty(min(chunk_size, n), V, dtype=torch.float32, device=hidden.device)  # [c, V]
            block = torch.empty(rows, V, dtype=torch.float32, device=hidden.device)  # [rows, V]
            logp = torch.empty(n, dtype=torch.float32, device=hidden.device)  # [N]
            entropy = torch.empty_like(logp)  # [N]
            lse = torch.empty_like(logp)  # [N] log-sum-exp of the (tempered) logits, reused by backward
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                z = _chunk_logits(hidden[s:e], w, b, temperature, logits[:e - s])  # [c, V]
                for r in range(0, e - s, rows):
                    zr = z[r:r + rows]  # [r, V] view
                    i = slice(s + r, s + r + zr.shape[0])  # the same tokens in the [N] outputs
                    z_max = zr.amax(dim=1, keepdim=True)  # [r, 1]
                    zr.sub_(z_max)  # shifted logits <= 0: exp cannot overflow
                    q = torch.exp(zr, out=block[:zr.shape[0]])  # unnormalised probabilities
                    total = q.sum(dim=1)  # [r]
                    log_total = torch.log(total)
                    logp[i] = zr.gather(1, targets[i].unsqueeze(1)).squeeze(1) - log_total
                    # H = -sum_v p_v (z_v - log_total) = log_total - sum_v q_v z_v / total; the product goes
                    # in place into q (a bmm row-dot would also avoid a buffer but sums far less accurately)
                    entropy[i] = log_total - q.mul_(zr).sum(dim=1) / total
                    lse[i] = z_max.squeeze(1) + log_total
            del logits, block
        ctx.save_for_backward(hidden, weight, bias, targets, lse, entropy)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        hidden, weight, bias, targets, lse, entropy = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            w = weight.float()
            b = None if bias is None else bias.float()
            n, V = hidden.shape[0], w.shape[0]
            grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) if need_h else None  # [N, H]
            grad_w = torch.zeros(w.shape, dtype=torch.float32, device=w.device) if need_w else None  # [V, H]
            grad_b = torch.zeros(b.shape, dtype=torch.float32, device=b.device) if need_b else None  # [V]
            g_lp = grad_logp.float().unsqueeze(1)  # [N, 1]
            g_ent = grad_entropy.float().unsqueeze(1)  # [N, 1]
            rows = max(1, min(chunk_size, _BLOCK_ELEMENTS // V))
            logits = torch.empty(min(chunk_size, n), V, dtype=torch.float32, device=hidden.device)  # [c, V]
            block = torch.empty(rows, V, dtype=torch.float32, device=hidden.device)  # [rows, V]
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                h = hidden[s:e].float()  # [c, H]
                z = _chunk_logits(h, w, b, temperature, logits[:e - s])  # [c, V]
                for r in range(0, e - s, rows):
                    zr = z[r:r + rows]  # [r, V] view
                    i = slice(s + r, s + r + zr.shape[0])
                    zr.sub_(lse[i].unsqueeze(1))  # log p_v
                    p = torch.exp(zr, out=block[:zr.shape[0]])  # [r, V]
                    # d logp_y / d z_v = 1[v = y] - p_v ;  d H / d z_v = -p_v (log p_v + H)
                    # => grad_z = p * (-g_ent * (log p + H) - g_lp) + g_lp * onehot(y), built in place in z
                    zr.add_(entropy[i].unsqueeze(1)).mul_(-g_ent[i]).sub_(g_lp[i]).mul_(p)
                    zr.scatter_add_(1, targets[i].unsqueeze(1), g_lp[i])
                if temperature != 1.0:
                    z.div_(temperature)  # the logits were divided by T
                if need_h:
                    torch.mm(z, w, out=grad_h[s:e])
                if need_w:
                    grad_w.addmm_(z.t(), h)
                if need_b:
                    grad_b.add_(z.sum(dim=0))
            del logits, block
        grads = [None if g is None else g.to(x.dtype) for g, x in ((grad_h, hidden), (grad_w, weight), (grad_b, bias))]
        return *grads, None, None, None  # in the inputs' dtypes


def fused_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           targets: torch.Tensor, temperature: float = 1.0,
                           chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) [N] and entropy [N] of softmax((hidden @ weight.T + bias) / temperature), chunk by chunk:
    hidden [N, H], weight [V, H] (the LM head), bias [V] or None, targets [N] long. Forward keeps only each token's
    log-sum-exp and entropy, backward recomputes each chunk's fp32 logits (also under autocast): no [N, V] tensor
    is kept. Differentiable in hidden, weight and bias; no host sync."""
    return _FusedLogprobEntropy.apply(hidden, weight, bias, targets, float(temperature), int(chunk_size))


def shared_prefix_len(rows: list[list[int]]) -> int:
    """Length of the token prefix that all `rows` share, capped so every row keeps >= 1 token after it.

    Host lists, so no device sync. Rendered from one template, all rows of an env start with the same system
    prompt and instructions (132 of ~235 tokens in a 1-turn Sokoban window of the tiny tokenizer);
    starpo.token_logprobs(prefix_len=) and sampler.generate run that part once instead of once per row."""
    n = min(map(len, rows), default=1) - 1
    for r in rows[1:]:
        n = next((k for k in range(n) if r[k] != rows[0][k]), n)
    return max(0, n)


def cache_keyword(model: torch.nn.Module) -> str:
    """The name of `model.base_model`'s KV-cache argument and output: `cache` in transformers >= 5.2x
    (`past_key_values` is deprecated there, removed in 5.40), `past_key_values` in 4.x and early 5.x."""
    return "cache" if "cache" in inspect.signature(model.base_model.forward).parameters else "past_key_values"


def token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, fused: bool = True, chunk_size: int = 1024, prefix_len: int = 0,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies [B, T] (the module docstring's token convention) of a Hugging Face causal LM
    at the sampling temperature. `fused=True`: `model.base_model`'s hidden states through `fused_logprobs_entropy`
    with the head of `model.get_output_embeddings()`; `fused=False`: the reference, `model(...).logits`. `model`
    may also be a TokenLogprobs module, or DistributedDataParallel around one.

    `prefix_len=P > 0` (fused only): the first P tokens are the same, unpadded, in every row
    (`shared_prefix_len`); the backbone runs them once and the B rows run the rest on that prefix's cache, at
    (T - P) / T of the backbone cost, with the plain path's values and gradients (tested).
    `positions` [B, T] (0/1 or bool, best on the CPU: no device sync): the tokens the caller reads, typically its
    loss mask; both outputs are 0 elsewhere and the fused path runs the LM head only there (replies are ~1/6 of
    a supervised batch's tokens).
    """
    if isinstance(model, TokenLogprobs) or isinstance(getattr(model, "module", None), TokenLogprobs):
        return model(input_ids, attention_mask, temperature, fused, chunk_size, prefix_len,  # through DDP's forward
                     positions)
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        raise ValueError("token_logprobs got DistributedDataParallel(model): wrap TokenLogprobs(model) instead, "
                         "or its gradients are never all-reduced (see TokenLogprobs)")
    B, T = input_ids.shape
    targets = input_ids[:, 1:].reshape(-1)  # [B*(T-1)]
    # [K] flat indices into the B*(T-1) predicted tokens that the caller reads (all of them without `positions`)
    keep = None if positions is None else positions[:, 1:].reshape(-1).nonzero().squeeze(1).to(input_ids.device)
    if model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        prefix_len = 0  # activation checkpointing runs without a cache (transformers turns use_cache off)
    if fused:
        if prefix_len > 0:  # one row runs the shared prefix; the B rows run the rest on its cache, repeated inside
            # the autograd graph (the prefix receives the sum of the rows' gradients)
            from transformers import DynamicCache  # explicit: given none, transformers 4.x returns a legacy tuple
            kw = cache_keyword(model)
            pre = model.base_model(input_ids=input_ids[:1, :prefix_len], use_cache=True, **{kw: DynamicCache()})
            pre[kw].batch_repeat_interleave(B)
            rest = model.base_model(input_ids=input_ids[:, prefix_len:], attention_mask=attention_mask,
                                    use_cache=True, **{kw: pre[kw]}).last_hidden_state  # [B, T-P, H], positions P..T-1
            hidden = torch.cat([pre.last_hidden_state.expand(B, -1, -1), rest], dim=1)  # [B, T, H]
        else:
            hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                      use_cache=False).last_hidden_state  # [B, T, H]
        head = model.get_output_embeddings()
        h = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # [B*(T-1), H] predicts tokens 1..T-1
        if keep is None:
            logp, entropy = fused_logprobs_entropy(h, head.weight, getattr(head, "bias", None), targets,
                                                   temperature, chunk_size)
        else:  # the head on the K kept rows only, scattered back into zeros
            lp, ent = fused_logprobs_entropy(h.index_select(0, keep), head.weight, getattr(head, "bias", None),
                                             targets.index_select(0, keep), temperature, chunk_size)  # [K]
            logp = lp.new_zeros(h.shape[0]).index_copy(0, keep, lp)  # [B*(T-1)]
            entropy = ent.new_zeros(h.shape[0]).index_copy(0, keep, ent)
    else:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
        logp, entropy = naive_logprobs_entropy_from_logits(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                           targets, temperature)
        if keep is not None:
            sel = torch.zeros_like(logp).index_fill(0, keep, 1.0)  # [B*(T-1)]
            logp, entropy = logp * sel, entropy * sel
    logp = F.pad(logp.view(B, T - 1), (1, 0))  # [B, T], column 0 = 0
    entropy = F.pad(entropy.view(B, T - 1), (1, 0))
    return logp, entropy


class TokenLogprobs(torch.nn.Module):
    """`token_logprobs(model, ...)` as a module's forward, the thing to wrap in DistributedDataParallel.

    DDP all-reduces gradients only for work done inside its own forward. The fused path reaches past the model's
    forward (to `model.base_model` and its head), so on DDP(model).module every rank would silently keep its own
    gradient; DDP(TokenLogprobs(model)) puts the whole path inside DDP's forward, on the model's own parameters.
    """

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:  # token_logprobs' arguments after model
        return token_logprobs(self.model, *args, **kwargs)


# ----------------------------------------------------------------------------------------------- Batch, config, update

@dataclass
class Batch:
    """One row per training trajectory; every tensor is [B, T], right-padded, aligned by token position."""
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] float, 1 on the tokens trained
    advantages: torch.Tensor  # [B, T]
    old_logp: torch.Tensor | None = None  # [B, T] log-probs under the rollout policy; None: see `update`
    ref_logp: torch.Tensor | None = None  # [B, T] log-probs under the initial policy (KL)
    returns: torch.Tensor | None = None  # [B, T] critic targets (PPO)
    old_values: torch.Tensor | None = None  # [B, T] critic values at rollout time (PPO)
    prefix_len: int = 0  # tokens that start every row identically (shared_prefix_len), run once

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn) -> "Batch":
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Batch(**{k: v if v is None or k == "prefix_len" else fn(v) for k, v in values.items()})

    def to(self, device) -> "Batch":
        return self._map(lambda t: t.to(device))

    def select(self, rows) -> "Batch":
        """Rows by index tensor, list or slice."""
        return self._map(lambda t: t[rows])


@dataclass
class UpdateConfig:
    mini_batch: int = 32  # trajectories per optimizer step (Appendix C.2)
    micro_batch: int = 4  # trajectories per forward/backward (gradient accumulation)
    clip_low: float = 0.2  # eps_low
    clip_high: float = 0.28  # eps_high, Clip-Higher (section 4.2; StarPO uses 0.2)
    agg: str = "token-mean"
    entropy_coef: float = 0.001
    kl_coef: float = 0.0  # 0 = KL removal (StarPO-S); StarPO uses 0.001
    kl_kind: str = "k3"
    value_clip: float = 0.5
    max_grad_norm: float = 1.0
    temperature: float = 1.0  # log-probs at the sampling temperature
    dual_clip: float | None = None  # verl's clip_ratio_c (> 1; RAGEN's runs: 3.0); 0 or None = off (the paper)
    fused: bool = True
    chunk_size: int = 1024


def make_optimizer(module: torch.nn.Module, lr: float, weight_decay: float = 0.01,
                   betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, weight decay 0.01: the optimizer `update` expects for the policy and
    the critic (torch's betas, as verl's), and that sft_baseline.py uses with its own beta2."""
    return torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr,
                             weight_decay=weight_decay, betas=betas)


# update's metrics: token-weighted means, and means over its optimizer steps
TOKEN_METRICS = ("entropy", "pg_clipfrac", "pg_clipfrac_upper", "pg_clipfrac_lower", "approx_kl", "kl_to_init",
                 "vf_clipfrac")
PER_STEP = ("pg_loss", "grad_norm", "kl_loss", "value_loss", "critic_grad_norm")


def micro_batches(n: int, micro: int, rank: int = 0, world: int = 1) -> list[list[int]]:
    """Row indices of an n-row mini-batch that `rank` trains, micro-batch by micro-batch: rows rank,
    rank + world, ... in groups of `micro`. Every rank gets the same number of micro-batches,
    ceil(ceil(n / world) / micro); a rank with fewer rows gets empty lists at the end (`update` runs a
    zero-weight micro-batch there). world = 1: consecutive slices, as a single process accumulates."""
    mine = list(range(rank, n, world))
    return [mine[j * micro:(j + 1) * micro] for j in range(math.ceil(math.ceil(n / world) / micro))]


def no_sync(*modules) -> contextlib.ExitStack:
    """Enter `no_sync()` of every DistributedDataParallel among `modules` (others have none)."""
    stack = contextlib.ExitStack()
    for module in modules:
        if hasattr(module, "no_sync"):
            stack.enter_context(module.no_sync())
    return stack


def update(policy: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, cfg: UpdateConfig,
           critic: torch.nn.Module | None = None, critic_optimizer: torch.optim.Optimizer | None = None,
           generator: torch.Generator | None = None, autocast_dtype: torch.dtype | None = None,
           shard: tuple[int, int] | None = None) -> dict[str, float]:
    """One pass of PPO/GRPO optimisation over `batch` (section 2.2); returns metrics as floats.

    The module docstring's loss; with `critic` (PPO: critic(ids, attn) -> values [B, T]) also the clipped value
    loss, on its own optimizer. Rows are shuffled with `generator` (CPU) into mini-batches of cfg.mini_batch rows,
    one optimizer step each, accumulated over micro-batches of cfg.micro_batch rows, each loss divided by the
    whole mini-batch's count (deviation 2); gradients clipped at cfg.max_grad_norm;
    a non-finite loss or grad norm skips the step, counted in `train/skipped_nonfinite`.
    `batch.old_logp = None`: fresh rollouts of this very policy that fit one mini-batch, whose ratio is exactly 1:
    the old log-probs are the forward's own, detached (TRL's GRPO does the same with one step per batch).
    `shard=(rank, world)` (deviation 8): the same `batch` and `generator` on every rank, the policy as
    DDP(TokenLogprobs(model)), the critic as DDP(critic); the divisor is the count / world (DDP averages).
    """
    if critic is not None and (critic_optimizer is None or batch.returns is None or batch.old_values is None):
        raise ValueError("a critic needs a critic_optimizer, batch.returns and batch.old_values")
    check_dual_clip(cfg.dual_clip)
    rank, world = shard if shard is not None else (0, 1)
    if world > 1 and generator is None:
        raise ValueError("with shard, every rank needs the same `generator` (same mini-batches)")
    ddp = torch.nn.parallel.DistributedDataParallel
    if world > 1 and not all(isinstance(m, ddp) for m in (policy, critic) if m is not None):
        raise ValueError("with shard, pass DistributedDataParallel(TokenLogprobs(model)) and DDP(critic): "
                         "without DDP the ranks' gradients are never averaged")
    device = next(policy.parameters()).device
    batch = batch.to(device)
    autocast = lambda: torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)  # noqa
    has_ref = batch.ref_logp is not None
    if batch.old_logp is None and len(batch) > cfg.mini_batch:
        raise ValueError("without old_logp the batch must fit one mini-batch (one optimizer step): after the first "
                         "step the updated policy is no longer the rollout policy")
    perm = torch.randperm(len(batch), generator=generator).to(device)
    optimizers = [optimizer] + ([critic_optimizer] if critic is not None else [])
    for o in optimizers:  # each step starts from zero gradients (and after each step they are zeroed)
        o.zero_grad(set_to_none=True)

    zero = lambda: torch.zeros((), device=device)  # noqa: E731
    # totals over the steps actually taken: token sums of the token metrics, per-step sums of PER_STEP
    # pg_clipfrac_dual only with dual clip on: without it the metrics are the paper's, as before
    keys = ["tokens", *TOKEN_METRICS, *(("pg_clipfrac_dual",) if cfg.dual_clip else ()), *PER_STEP]
    totals = {k: zero() for k in keys}
    steps_taken = skipped = 0

    for start in range(0, len(batch), cfg.mini_batch):
        mb = batch.select(perm[start:start + cfg.mini_batch])
        m = mb.loss_mask > 0
        tokens = m.sum().float()
        count = tokens if cfg.agg == "token-mean" else (m.sum(dim=1) > 0).sum().float()
        denom, token_denom = count.clamp(min=1) / world, tokens.clamp(min=1) / world  # the global counts (DDP averages)
        step = {k: zero() for k in keys}
        finite = torch.ones((), dtype=torch.bool, device=device)
        plan = micro_batches(len(mb), cfg.micro_batch, rank, world)
        for j, rows in enumerate(plan):
            # a rank out of rows trains row 0 with an all-zero mask: gradient exactly 0, but it joins the
            # all-reduce (DDP all-reduces at every backward outside no_sync; the ranks must match)
            mi = mb.select(rows) if rows else dataclasses.replace(mb.select([0]), loss_mask=mb.loss_mask[:1] * 0)
            n_tok = (mi.loss_mask > 0).sum().float()
            # gradient accumulation: DDP all-reduces only at the mini-batch's last backward
            with no_sync(policy, critic) if j < len(plan) - 1 else contextlib.nullcontext():
                with autocast():
                    logp, ent = token_logprobs(policy, mi.input_ids, mi.attention_mask, cfg.temperature, cfg.fused,
                                               cfg.chunk_size, prefix_len=mi.prefix_len)
                # no old_logp: the batch is one optimizer step on fresh rollouts, whose policy is this one
                old_logp = mi.old_logp if mi.old_logp is not None else logp.detach()
                pg, pm = policy_loss(logp, old_logp, mi.advantages, mi.loss_mask, cfg.clip_low, cfg.clip_high,
                                     cfg.agg, denom=denom, dual_clip=cfg.dual_clip)
                loss = pg - cfg.entropy_coef * aggregate(ent, mi.loss_mask, cfg.agg, denom)
                if has_ref:
                    kl_tok = kl_penalty(logp, mi.ref_logp, cfg.kl_kind)  # [b, T]
                    kl_term = aggregate(kl_tok, mi.loss_mask, cfg.agg, denom)
                    if cfg.kl_coef != 0.0:
                        loss = loss + cfg.kl_coef * kl_term
                    step["kl_loss"] += kl_term.detach()
                    step["kl_to_init"] += masked_mean(kl_tok.detach(), mi.loss_mask) * n_tok
                loss.backward()
                finite &= torch.isfinite(loss.detach())
                step["tokens"] += n_tok
                step["pg_loss"] += pg.detach()
                step["entropy"] += masked_mean(ent.detach(), mi.loss_mask) * n_tok
                for k, v in pm.items():
                    if k in step:  # pg_clipfrac_dual is a key only with dual clip on
                        step[k] += v * n_tok  # token means back to token sums

                if critic is not None:
                    with autocast():
                        values = critic(mi.input_ids, mi.attention_mask)  # [b, T]
                    vl, vm = value_loss(values, mi.old_values, mi.returns, mi.loss_mask, cfg.value_clip,
                                        denom=token_denom)
                    vl.backward()
                    finite &= torch.isfinite(vl.detach())
                    step["value_loss"] += vl.detach()
                    step["vf_clipfrac"] += vm["vf_clipfrac"] * n_tok

        grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        finite &= torch.isfinite(grad_norm)
        step["grad_norm"] = grad_norm.detach().float()
        if critic is not None:
            critic_norm = torch.nn.utils.clip_grad_norm_(critic.parameters(), cfg.max_grad_norm)
            finite &= torch.isfinite(critic_norm)
            step["critic_grad_norm"] = critic_norm.detach().float()
        if world > 1:  # every rank must take the same decision, or the replicas drift apart
            finite = finite.float()
            torch.distributed.all_reduce(finite, op=torch.distributed.ReduceOp.MIN)
        if bool(finite):  # the one host sync per optimizer step: whether to step at all
            for o in optimizers:
                o.step()
            for k in keys:
                totals[k] += step[k]
            steps_taken += 1
        else:
            skipped += 1
        for o in optimizers:
            o.zero_grad(set_to_none=True)

    stacked = torch.stack([totals[k] for k in keys])
    if world > 1:  # token sums add up; per-step sums were each rank's world-scaled share (grad norms: equal)
        torch.distributed.all_reduce(stacked)
        per_step = torch.tensor([k in PER_STEP for k in keys], device=device)
        stacked = torch.where(per_step, stacked / world, stacked)
    host = dict(zip(keys, stacked.tolist()))  # one sync for all metrics
    n_steps = steps_taken if steps_taken else math.nan
    n_tokens = host["tokens"] if host["tokens"] > 0 else math.nan
    absent = (set() if has_ref else {"kl_to_init", "kl_loss"}) | \
        (set() if critic is not None else {"value_loss", "vf_clipfrac", "critic_grad_norm"})
    return {**{f"train/{k}": host[k] / (n_steps if k in PER_STEP else n_tokens) for k in keys[1:] if k not in absent},
            "train/skipped_nonfinite": float(skipped), "train/optimizer_steps": float(steps_taken)}
