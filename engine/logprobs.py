"""The fused log-prob path: per-token log-probs and entropies of a causal LM without the [B, T, V] logits
(V = 151,936 for Qwen2.5: 1.2 GB per 2k tokens in fp32). starpo.token_logprobs states the convention and
holds the plain path; its `fused=True` calls `fused_token_logprobs` here.

The LM head runs chunk by chunk in fp32 (also under bf16 autocast; HF and verl use a bf16 head) and each
chunk is recomputed in backward; it assumes logits = lm_head(last hidden state) (Qwen2/Llama/Mistral; others:
`fused=False`). A prompt header shared by every row (`shared_prefix_len`) runs once. Tested against the plain
path (values and gradients); `TokenLogprobs` is the module DDP wraps under torchrun. Also the right-padded
[B, T] rows (`pad_segments`) and the drift between these log-probs and the sampler's (`add_drift`). Optional
reading: speed and memory, not the method.
"""
from __future__ import annotations

import inspect
import math

import torch
import torch.nn.functional as F


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
            grad_h = torch.empty(hidden.shape, dtype=torch.float32, device=hidden.device) \
                if need_h else None  # [N, H]
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
        grads = [None if g is None else g.to(x.dtype)
                 for g, x in ((grad_h, hidden), (grad_w, weight), (grad_b, bias))]
        return *grads, None, None, None  # in the inputs' dtypes


def fused_logprobs_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                           targets: torch.Tensor, temperature: float = 1.0,
                           chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """log p(target) [N] and entropy [N] of softmax((hidden @ weight.T + bias) / temperature), chunk by chunk:
    hidden [N, H], weight [V, H] (the LM head), bias [V] or None, targets [N] long. Forward keeps only each
    token's log-sum-exp and entropy, backward recomputes each chunk's fp32 logits (also under autocast): no
    [N, V] tensor is kept. Differentiable in hidden, weight and bias; no host sync."""
    return _FusedLogprobEntropy.apply(hidden, weight, bias, targets, float(temperature), int(chunk_size))


def pad_logps(segs, T: int) -> torch.Tensor:
    """The sampler's log-probs [B, T], NaN elsewhere."""
    return torch.tensor([s.logp + [math.nan] * (T - len(s.logp)) for s in segs])


def pad_segments(segs, pad_id: int):
    """Right-pad segments (rollout.Segment) -> input_ids, attention_mask, loss_mask (float), [B, T] each."""
    T = max(len(s.input_ids) for s in segs)
    ids = torch.full((len(segs), T), pad_id, dtype=torch.long)
    attn = torch.zeros((len(segs), T), dtype=torch.long)
    mask = torch.zeros((len(segs), T))
    for i, s in enumerate(segs):
        n = len(s.input_ids)
        ids[i, :n] = torch.tensor(s.input_ids)
        attn[i, :n] = 1
        mask[i, :n] = torch.tensor(s.loss_mask, dtype=torch.float)
    return ids, attn, mask


def shared_prefix_len(rows: list[list[int]]) -> int:
    """Length of the token prefix that all `rows` share, capped so every row keeps >= 1 token after it.

    Host lists, so no device sync. Rendered from one template, all rows of an env start with the same system
    prompt and instructions (132 of ~235 tokens in a 1-turn Sokoban window of the tiny tokenizer);
    token_logprobs(prefix_len=) runs that part once instead of once per row."""
    n = min(map(len, rows), default=1) - 1
    for r in rows[1:]:
        n = next((k for k in range(n) if r[k] != rows[0][k]), n)
    return max(0, n)


def cache_keyword(model: torch.nn.Module) -> str:
    """The name of `model.base_model`'s KV-cache argument and output: `cache` in transformers >= 5.2x
    (`past_key_values` is deprecated there, removed in 5.40), `past_key_values` in 4.x and early 5.x."""
    return "cache" if "cache" in inspect.signature(model.base_model.forward).parameters else "past_key_values"


def fused_token_logprobs(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                         temperature: float = 1.0, chunk_size: int = 1024, prefix_len: int = 0,
                         positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """starpo.token_logprobs' fused path (its convention, its arguments): `model.base_model`'s hidden states
    through `fused_logprobs_entropy` with the head of `model.get_output_embeddings()`, never the [B, T, V]
    logits. Values and gradients equal the plain path's (tested).

    `prefix_len=P > 0`: the first P tokens are the same, unpadded, in every row (`shared_prefix_len`); the
    backbone runs them once and the B rows run the rest on that prefix's cache, at (T - P) / T of the backbone
    cost. `positions` [B, T] (0/1 or bool, best on the CPU: no device sync): the LM head runs only there.
    """
    B, T = input_ids.shape
    targets = input_ids[:, 1:].reshape(-1)  # [B*(T-1)]
    # [K] flat indices into the B*(T-1) predicted tokens that the caller reads (all without `positions`)
    keep = None if positions is None else \
        positions[:, 1:].reshape(-1).nonzero().squeeze(1).to(input_ids.device)
    if model.training and any(getattr(m, "gradient_checkpointing", False) for m in model.modules()):
        prefix_len = 0  # activation checkpointing runs without a cache (transformers turns use_cache off)
    if prefix_len > 0:  # one row runs the shared prefix; the B rows run the rest on its cache, repeated
        # inside the autograd graph (the prefix receives the sum of the rows' gradients)
        from transformers import DynamicCache  # explicit: given none, transformers 4.x returns a tuple
        kw = cache_keyword(model)
        pre = model.base_model(input_ids=input_ids[:1, :prefix_len], use_cache=True, **{kw: DynamicCache()})
        pre[kw].batch_repeat_interleave(B)
        rest = model.base_model(input_ids=input_ids[:, prefix_len:], attention_mask=attention_mask,
                                use_cache=True, **{kw: pre[kw]}).last_hidden_state  # [B, T-P, H]
        hidden = torch.cat([pre.last_hidden_state.expand(B, -1, -1), rest], dim=1)  # [B, T, H]
    else:
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  use_cache=False).last_hidden_state  # [B, T, H]
    head = model.get_output_embeddings()
    bias = getattr(head, "bias", None)
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])  # [B*(T-1), H] predicts tokens 1..T-1
    if keep is None:
        logp, entropy = fused_logprobs_entropy(h, head.weight, bias, targets, temperature, chunk_size)
    else:  # the head on the K kept rows only, scattered back into zeros
        lp, ent = fused_logprobs_entropy(h.index_select(0, keep), head.weight, bias,
                                         targets.index_select(0, keep), temperature, chunk_size)  # [K]
        logp = lp.new_zeros(h.shape[0]).index_copy(0, keep, lp)  # [B*(T-1)]
        entropy = ent.new_zeros(h.shape[0]).index_copy(0, keep, ent)
    logp = F.pad(logp.view(B, T - 1), (1, 0))  # [B, T], column 0 = 0
    entropy = F.pad(entropy.view(B, T - 1), (1, 0))
    return logp, entropy


def sorted_micro_batches(segs, micro: int):
    """Segments in length-sorted micro-batches (less padding; a summed gradient is the same): SFT's."""
    segs = sorted(segs, key=lambda s: len(s.input_ids))
    return [segs[i:i + micro] for i in range(0, len(segs), micro)]


def add_drift(drift: torch.Tensor, old_logp: torch.Tensor, rollout_logp: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """The train-inference mismatch: `drift` [sum, tokens, max] of |old_logp - the sampler's log-prob| over
    the trained tokens whose sampled log-prob was recorded, with these [b, T] rows added; no host sync."""
    seen = torch.isfinite(rollout_logp) & (mask > 0)
    d = torch.where(seen, (old_logp.float() - rollout_logp).abs(), 0.0)
    return torch.stack([drift[0] + d.sum(), drift[1] + seen.sum(), torch.maximum(drift[2], d.max())])


def drift_metrics(drift: torch.Tensor, world: int = 1) -> dict:
    """rollout/logp_diff_mean and _max from `drift` (over all ranks when `world` > 1); {} if none recorded."""
    if world > 1:
        torch.distributed.all_reduce(drift[:2])
        torch.distributed.all_reduce(drift[2:], op=torch.distributed.ReduceOp.MAX)
    d_sum, d_n, d_max = drift.tolist()
    return {"rollout/logp_diff_mean": d_sum / d_n, "rollout/logp_diff_max": d_max} if d_n else {}


class TokenLogprobs(torch.nn.Module):
    """`fn(model, ...)` (starpo.token_logprobs) as a module's forward, the thing to wrap in
    DistributedDataParallel.

    DDP all-reduces gradients only for work done inside its own forward. The fused path reaches past the
    model's forward (to `model.base_model` and its head), so on DDP(model).module every rank would silently
    keep its own gradient; DDP(TokenLogprobs(model, fn)) puts the whole path inside DDP's forward.
    """

    def __init__(self, model: torch.nn.Module, fn):
        super().__init__()
        self.model = model
        self.fn = fn

    def forward(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:  # fn's arguments after `model`
        return self.fn(self.model, *args, **kwargs)
