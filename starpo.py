"""StarPO's update (paper section 2.2): the clipped token-level policy loss, the entropy bonus, the KL to the
initial policy, PPO's critic and its clipped value loss, and `update`, one pass of mini-batch steps.

Per sampled token t of a trajectory (mask[:, t] == 1), with A_t from advantages.py:
    ratio_t = exp(logp_t - old_logp_t)                                    (log-ratio clamped to +-20)
    pg_t    = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    loss    = agg(pg) - entropy_coef * agg(entropy) + kl_coef * agg(kl(logp, ref_logp))
StarPO-S (section 4.2): eps_low 0.2 / eps_high 0.28 (Clip-Higher), kl_coef 0 (StarPO: 0.2 / 0.2, 0.001).
Appendix C.2: entropy 0.001, 32 trajectories per optimizer step accumulated over micro-batches; agg is a token
mean over the mini-batch's sampled tokens. All tensors are [B, T], right-padded, one row per trajectory, and
follow engine/logprobs.py's convention (logp[:, t] scores token t). Next: train.py, which builds the batch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn as nn

from engine.logprobs import token_logprobs

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOG_RATIO_CLAMP = 20.0


# ---------------------------------------------------------------------------------------------------- losses

def aggregate(loss_tok: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
              denom: torch.Tensor | float | None = None) -> torch.Tensor:
    """Reduce a per-token loss [B, T] over the sampled tokens to a scalar.

    token-mean:           sum over sampled tokens / number of sampled tokens
    seq-mean-token-mean:  per row, mean over its sampled tokens; then sum over rows / number of non-empty rows
    seq-mean-token-sum:   per row, sum over its sampled tokens; then sum over rows / number of non-empty rows
    `denom` overrides the divisor: `update` passes the whole mini-batch's count, so that micro-batch losses
    add up exactly to the mini-batch loss.
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


def check_dual_clip(dual_clip: float | None) -> None:
    """0 or None turns dual clip off; otherwise it must exceed 1, as verl asserts for clip_ratio_c."""
    if dual_clip and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (verl's clip_ratio_c; 0 or None = off), got {dual_clip}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.28, agg: str = "token-mean",
                denom: torch.Tensor | float | None = None,
                dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with decoupled bounds (Clip-Higher, section 4.2): pg_t of the module docstring,
    aggregated. `dual_clip=c > 1` (beyond the paper: verl's clip_ratio_c, RAGEN's later runs 3.0) caps the
    loss of a token with A < 0 at -A * c, so a huge ratio on a bad action cannot dominate the batch.
    -> (loss, metrics as 0-dim tensors, no host sync): pg_clipfrac (any side), pg_clipfrac_upper (ratio above
    1 + eps_high, A > 0), pg_clipfrac_lower (below 1 - eps_low, A < 0), pg_clipfrac_dual (where the cap bites;
    verl calls it pg_clipfrac_lower), approx_kl (k1 to the old policy, verl's ppo_kl)."""
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
        dual = (adv < 0) & (loss_tok > cap)
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

    k1: logp - ref_logp (unbiased, high variance, can be negative; RAGEN's `kl`, the paper's runs).
    k3: r - log r - 1 with r = pi_ref / pi, verl's `low_var_kl` (log r clamped to +-20, the result to
        [-10, 10]); non-negative, low variance.
    """
    if kind == "k1":
        return logp.float() - ref_logp.float()
    log_r = (ref_logp.float() - logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)


class Critic(nn.Module):
    """PPO's value model (Appendix A): a separate copy of the policy's backbone and a scalar head, initialised
    to zero (the first values are 0, not noise). values[:, t] is the value of the state just before token t
    (read from the hidden state at t - 1), aligned with logp[:, t]. engine/models.load_critic builds it."""

    def __init__(self, backbone: nn.Module):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
        v = self.value_head(h).squeeze(-1).float()                                               # [B, T]
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)

    def save_pretrained(self, path: str) -> None:
        from engine.lora import plain_state_dict
        from pathlib import Path
        self.backbone.save_pretrained(path, state_dict=plain_state_dict(self.backbone))
        torch.save(self.value_head.state_dict(), Path(path) / "value_head.pt")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.5,
               denom: torch.Tensor | float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (Appendix A): 0.5 * token-mean of max((V - R)^2, (V_clip - R)^2), V_clip =
    old_V + clip(V - old_V, -clip, clip). -> (loss, {"vf_clipfrac": share of tokens where the clipped error
    is the larger})."""
    m = mask > 0
    v = values.float()
    ret = torch.where(m, returns.float(), v.detach())
    old = torch.where(m, old_values.float(), v.detach())
    err = (v - ret) ** 2
    # clamp v itself into [old - clip, old + clip]: exact inside (old + (v - old) may round off by an ulp)
    err_clipped = (torch.minimum(torch.maximum(v, old - clip), old + clip) - ret) ** 2
    frac = masked_mean((err_clipped > err).float(), mask)
    return 0.5 * aggregate(torch.maximum(err, err_clipped), mask, "token-mean", denom), {"vf_clipfrac": frac}


# ------------------------------------------------------------------------------------------------- the batch

def pad_segments(segs, pad_id: int):
    """Right-pad segments -> input_ids [B, T], attention_mask [B, T], loss_mask [B, T] (float)."""
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


@dataclass
class Batch:
    """One row per training sequence; every tensor is [B, T], right-padded, aligned by token position."""
    input_ids: torch.Tensor  # [B, T] long
    attention_mask: torch.Tensor  # [B, T] long
    loss_mask: torch.Tensor  # [B, T] float, 1 on the tokens trained
    advantages: torch.Tensor  # [B, T]
    old_logp: torch.Tensor | None = None  # [B, T] log-probs under the rollout policy; None: see `update`
    ref_logp: torch.Tensor | None = None  # [B, T] log-probs under the initial policy (KL)
    returns: torch.Tensor | None = None  # [B, T] critic targets (PPO)
    old_values: torch.Tensor | None = None  # [B, T] critic values at rollout time (PPO)
    prefix_len: int = 0  # tokens that start every row identically (engine/logprobs.shared_prefix_len)

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
    dual_clip: float | None = None  # beyond the paper: verl's clip_ratio_c (> 1); 0 or None = off
    fused: bool = True  # engine/logprobs.py's chunked path
    chunk_size: int = 1024


def make_optimizer(module: nn.Module, lr: float, weight_decay: float = 0.01,
                   betas: tuple[float, float] = (0.9, 0.999)) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters, weight decay 0.01 (torch's betas, as verl's)."""
    return torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=lr,
                             weight_decay=weight_decay, betas=betas)


# ---------------------------------------------------------------------------------------------------- update

# update's metrics: token-weighted means, and means over its optimizer steps
TOKEN_METRICS = ("entropy", "pg_clipfrac", "pg_clipfrac_upper", "pg_clipfrac_lower", "approx_kl",
                 "kl_to_init", "vf_clipfrac")
PER_STEP = ("pg_loss", "grad_norm", "kl_loss", "value_loss", "critic_grad_norm")


def micro_batches(n: int, micro: int, rank: int = 0, world: int = 1) -> list[list[int]]:
    """Row indices of an n-row mini-batch that `rank` trains, micro-batch by micro-batch: rows rank,
    rank + world, ... in groups of `micro`. Every rank gets ceil(ceil(n / world) / micro) micro-batches; a
    rank with fewer rows gets empty lists at the end (`update` runs a zero-weight micro-batch there).
    world = 1: consecutive slices, as a single process accumulates."""
    mine = list(range(rank, n, world))
    return [mine[j * micro:(j + 1) * micro] for j in range(math.ceil(math.ceil(n / world) / micro))]


def no_sync(*modules) -> contextlib.ExitStack:
    """Enter `no_sync()` of every DistributedDataParallel among `modules` (others have none)."""
    stack = contextlib.ExitStack()
    for module in modules:
        if hasattr(module, "no_sync"):
            stack.enter_context(module.no_sync())
    return stack


def update(policy: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, cfg: UpdateConfig,
           critic: nn.Module | None = None, critic_optimizer: torch.optim.Optimizer | None = None,
           generator: torch.Generator | None = None, autocast_dtype: torch.dtype | None = None,
           shard: tuple[int, int] | None = None) -> dict[str, float]:
    """One pass of PPO/GRPO optimisation over `batch` (section 2.2); -> metrics as floats.

    Rows are shuffled with `generator` (CPU) into mini-batches of cfg.mini_batch rows, one optimizer step
    each, accumulated over micro-batches of cfg.micro_batch rows, each loss divided by the whole mini-batch's
    count (so micro-batching changes nothing); gradients clipped at cfg.max_grad_norm. A non-finite loss or
    grad norm skips the step (`train/skipped_nonfinite`): one host sync per step. With `critic` (PPO) the
    value loss trains it on its own optimizer. `batch.old_logp = None`: fresh rollouts of this very policy
    that fit one mini-batch, whose ratio is exactly 1: the forward's own log-probs, detached, are the old
    ones.
    `shard=(rank, world)` (torchrun): the same batch and generator on every rank, the policy as
    DDP(TokenLogprobs(model)), the critic as DDP(critic); each rank trains rows rank, rank + world, ...
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
    autocast = lambda: torch.autocast(device.type, dtype=autocast_dtype,  # noqa: E731
                                      enabled=autocast_dtype is not None)
    has_ref = batch.ref_logp is not None
    if batch.old_logp is None and len(batch) > cfg.mini_batch:
        raise ValueError("without old_logp the batch must fit one mini-batch (one optimizer step): after the "
                         "first step the updated policy is no longer the rollout policy")
    perm = torch.randperm(len(batch), generator=generator).to(device)
    optimizers = [optimizer] + ([critic_optimizer] if critic is not None else [])
    for o in optimizers:  # each step starts from zero gradients (and after each step they are zeroed)
        o.zero_grad(set_to_none=True)

    zero = lambda: torch.zeros((), device=device)  # noqa: E731
    # totals over the steps taken: token sums of the token metrics, per-step sums of PER_STEP;
    # pg_clipfrac_dual only with dual clip on (without it the metrics are the paper's)
    keys = ["tokens", *TOKEN_METRICS, *(("pg_clipfrac_dual",) if cfg.dual_clip else ()), *PER_STEP]
    totals = {k: zero() for k in keys}
    steps_taken = skipped = 0

    for start in range(0, len(batch), cfg.mini_batch):
        mb = batch.select(perm[start:start + cfg.mini_batch])
        m = mb.loss_mask > 0
        tokens = m.sum().float()
        count = tokens if cfg.agg == "token-mean" else (m.sum(dim=1) > 0).sum().float()
        # the global counts (DDP averages the ranks' gradients)
        denom, token_denom = count.clamp(min=1) / world, tokens.clamp(min=1) / world
        step = {k: zero() for k in keys}
        finite = torch.ones((), dtype=torch.bool, device=device)
        plan = micro_batches(len(mb), cfg.micro_batch, rank, world)
        for j, rows in enumerate(plan):
            # a rank out of rows trains row 0 with an all-zero mask: gradient exactly 0, but it joins the
            # all-reduce (DDP all-reduces at every backward outside no_sync; the ranks must match)
            mi = mb.select(rows) if rows else \
                dataclasses.replace(mb.select([0]), loss_mask=mb.loss_mask[:1] * 0)
            n_tok = (mi.loss_mask > 0).sum().float()
            # gradient accumulation: DDP all-reduces only at the mini-batch's last backward
            with no_sync(policy, critic) if j < len(plan) - 1 else contextlib.nullcontext():
                with autocast():
                    logp, ent = token_logprobs(policy, mi.input_ids, mi.attention_mask, cfg.temperature,
                                               cfg.fused, cfg.chunk_size, prefix_len=mi.prefix_len)
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
    return {**{f"train/{k}": host[k] / (n_steps if k in PER_STEP else n_tokens) for k in keys[1:]
               if k not in absent},
            "train/skipped_nonfinite": float(skipped), "train/optimizer_steps": float(steps_taken)}
