"""StarPO's update (paper section 2.2): the clipped policy loss, entropy bonus, KL to the initial policy,
PPO's critic and value loss, `build_batch` (the log-probs and values the losses read), and `update`, one
pass of mini-batch steps. Per sampled token t, A_t from advantages.py:
    ratio_t = exp(logp_t - old_logp_t)        (the log-ratio clamped to +-20)
    pg_t    = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - eps_low, 1 + eps_high))
    loss    = agg(pg) - entropy_coef * agg(entropy) + kl_coef * agg(kl(logp, ref_logp))
StarPO-S (section 4.2): eps_low 0.2, eps_high 0.28 (Clip-Higher), kl_coef 0 (StarPO: 0.2, 0.2, 0.001).
Appendix C.2: entropy 0.001, 32 trajectories per optimizer step, agg a token mean over the mini-batch.
Tensors are [B, T], right-padded, one row per sequence. Next: train.py, the loop that calls these.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from engine.distributed import all_ranks, check_shard, map_rows, micro_batches, no_sync, sum_ranks
from engine.logprobs import TokenLogprobs, add_drift, drift_metrics, fused_token_logprobs, pad_logps
from engine.logprobs import pad_segments, shared_prefix_len
from engine.lora import adapters_off
from engine.models import visiting
from rollout import Segment, trained_mask

AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOG_RATIO_CLAMP = 20.0


# ---- log-probs: the one token convention every loss below depends on

def token_logprobs(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                   temperature: float = 1.0, fused: bool = True, chunk_size: int = 1024, prefix_len: int = 0,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs and entropies [B, T] of a causal LM, at the sampling temperature (the ratio's two
    log-probs must be of one distribution). The convention: logp[:, t] = log p(input_ids[:, t] |
    input_ids[:, :t]), so column 0 is 0 (nothing predicts the first token) and a loss mask on the sampled
    tokens lines up with logp as it is; entropy[:, t] is the entropy of that same distribution.

    `fused=True` computes the same numbers without the [B, T, V] logits, the shared prompt header
    (`prefix_len`) run once (engine/logprobs.py, tested equal). `positions` [B, T]: the tokens the caller
    reads; both outputs are 0 elsewhere. `model` may be a TokenLogprobs, or DDP around one (torchrun)."""
    if isinstance(model, TokenLogprobs) or isinstance(getattr(model, "module", None), TokenLogprobs):
        return model(input_ids, attention_mask, temperature, fused, chunk_size, prefix_len, positions)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ValueError("token_logprobs got DistributedDataParallel(model): wrap TokenLogprobs(model, "
                         "token_logprobs) instead, or its gradients are never all-reduced (TokenLogprobs)")
    if fused:
        return fused_token_logprobs(model, input_ids, attention_mask, temperature, chunk_size, prefix_len,
                                    positions)
    logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits  # [B, T, V]
    logp_all = torch.log_softmax(logits[:, :-1].float() / temperature, dim=-1)  # [B, T-1, V]: t predicts t+1
    logp = logp_all.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)  # [B, T-1]
    entropy = -(logp_all.exp() * logp_all).sum(-1)  # [B, T-1]
    if positions is not None:
        read = positions[:, 1:].to(logp.device).float()  # [B, T-1]
        logp, entropy = logp * read, entropy * read
    return F.pad(logp, (1, 0)), F.pad(entropy, (1, 0))  # [B, T], column 0 = 0


# ---- losses

def aggregate(loss_tok: torch.Tensor, mask: torch.Tensor, agg: str = "token-mean",
              denom: torch.Tensor | float | None = None) -> torch.Tensor:
    """A per-token loss [B, T] -> a scalar: token-mean, or each row's mean (sum) then their mean. `denom`:
    the whole mini-batch's count, so micro-batches add up."""
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
    """Mean of x where mask == 1 (0 if none), with no host sync."""
    m = mask > 0
    return torch.where(m, x, 0.0).sum() / m.sum().clamp(min=1)


def check_dual_clip(dual_clip: float | None) -> None:
    """0 or None: off; else > 1, as verl asserts."""
    if dual_clip and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1 (verl's clip_ratio_c; 0 or None = off), got {dual_clip}")


def policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_low: float = 0.2, clip_high: float = 0.28, agg: str = "token-mean",
                denom: torch.Tensor | float | None = None,
                dual_clip: float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped surrogate with Clip-Higher's bounds (section 4.2): pg_t above. Beyond the paper,
    `dual_clip` c > 1 (verl's clip_ratio_c) caps the loss at -A * c where A < 0. -> (loss, metrics)."""
    check_dual_clip(dual_clip)
    m = mask > 0
    # off the mask A = 0, old = logp: padding never counts; A and the old log-probs are constants (detached)
    adv = torch.where(m, advantages.detach().float(), 0.0)
    old = torch.where(m, old_logp.detach().float(), logp.detach().float())
    log_ratio = (logp.float() - old).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(unclipped, clipped)  # [B, T]
    dual = torch.zeros_like(m)  # [B, T]
    if dual_clip:  # beyond the paper
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
    """KL(pi || pi_ref) per token [B, T]: k1 = logp - ref_logp (the paper's runs), or k3 = r - log r - 1,
    r = pi_ref / pi (verl's low_var_kl)."""
    if kind == "k1":
        return logp.float() - ref_logp.float()
    log_r = (ref_logp.float() - logp.float()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)


class Critic(nn.Module):
    """PPO's value model (Appendix A): the policy's backbone, a zero-initialised scalar head. values[:, t]:
    the value of the state before token t."""

    def __init__(self, backbone: nn.Module, head_state: dict | None = None):
        super().__init__()
        self.backbone = backbone
        self.value_head = nn.Linear(backbone.config.hidden_size, 1)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)
        if head_state is not None:  # a critic's own checkpoint (engine/models.load_critic)
            self.value_head.load_state_dict(head_state)
        self.value_head.to(next(backbone.parameters()).device)

    def forward(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # [B, T, H]
        v = self.value_head(h).squeeze(-1).float()                                               # [B, T]
        return torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)

    def save_pretrained(self, path: str) -> None:
        from engine.lora import plain_state_dict
        self.backbone.save_pretrained(path, state_dict=plain_state_dict(self.backbone))
        torch.save(self.value_head.state_dict(), f"{path}/value_head.pt")


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip: float = 0.5,
               denom: torch.Tensor | float | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO's clipped value loss (Appendix A): 0.5 * mean of max((V - R)^2, (V_clip - R)^2)."""
    m = mask > 0
    v = values.float()
    ret = torch.where(m, returns.float(), v.detach())
    old = torch.where(m, old_values.float(), v.detach())
    err = (v - ret) ** 2
    err_clipped = (torch.minimum(torch.maximum(v, old - clip), old + clip) - ret) ** 2
    frac = masked_mean((err_clipped > err).float(), mask)
    return 0.5 * aggregate(torch.maximum(err, err_clipped), mask, "token-mean", denom), {"vf_clipfrac": frac}


# ---- the batch

@dataclass
class Batch:
    """One row per training sequence; every tensor [B, T], right-padded."""
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor  # float, 1 on the tokens trained
    advantages: torch.Tensor
    old_logp: torch.Tensor | None = None  # the rollout policy's (None: see `update`)
    ref_logp: torch.Tensor | None = None  # the initial policy's (the KL)
    returns: torch.Tensor | None = None  # PPO: the critic's targets
    old_values: torch.Tensor | None = None  # PPO: the critic's values at rollout time
    prefix_len: int = 0  # tokens that start every row alike (run once)
    rollout_logp: torch.Tensor | None = None  # the sampler's log-probs, to measure drift

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def _map(self, fn) -> "Batch":
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Batch(**{k: v if v is None or k == "prefix_len" else fn(v) for k, v in values.items()})

    def to(self, device) -> "Batch":
        return self._map(lambda t: t.to(device))

    def select(self, rows) -> "Batch":
        return self._map(lambda t: t[rows])


@torch.no_grad()
def build_batch(rows: list, models: dict, pad_id: int, cfg, device, amp, old_logp: bool,
                ref_logp: bool) -> Batch:
    """The update's inputs (section 2.2, Appendix A), without the advantages (advantages.py's
    estimators fill them in): one row per (segment, trajectory) of `rows`, padded, and the log-probs
    and values the losses read. `models`: the policy, its KL reference (None under LoRA: the policy
    with its adapters off) and the critic (or None). `old_logp`: run the policy for the ratio's
    denominator (a batch taking one optimizer step on fresh rollouts has ratio 1: `update` uses the
    detached log-probs instead); `ref_logp`: run the KL reference. `cfg`: train.py's Config."""
    segs = [Segment(s.input_ids, trained_mask(s, cfg.response_mask)) for s, _ in rows]
    ids, attn, mask = [x.to(device) for x in pad_segments(segs, pad_id)]  # [B, T] each
    pre = shared_prefix_len([s.input_ids for s in segs])  # run once

    def logps(model, base_only=False):  # [B, T], micro-batch by micro-batch
        def fn(i, a):
            # base_only: a LoRA policy's frozen base, its KL reference
            on = adapters_off(model) if base_only else visiting(model, device)
            with on:
                logp, _ = token_logprobs(model, i, a, cfg.temperature, cfg.fused, prefix_len=pre)
            return logp.float()
        return map_rows(fn, ids, attn, cfg.micro_batch)

    policy, ref, critic = models["policy"], models["ref"], models["critic"]
    old = ref_lp = values = None
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        if old_logp:
            old = logps(policy)  # [B, T]
        if ref_logp:
            ref_lp = logps(policy, base_only=True) if ref is None else logps(ref)  # [B, T]
        if critic is not None:
            values = map_rows(critic, ids, attn, cfg.micro_batch).float()  # [B, T]
    sampled = pad_logps([s for s, _ in rows], ids.shape[1]).to(device)  # [B, T], the sampler's
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=mask, advantages=None, old_logp=old,
                 ref_logp=ref_lp, old_values=values, prefix_len=pre, rollout_logp=sampled)


@dataclass
class UpdateConfig:
    mini_batch: int = 32  # sequences per optimizer step (Appendix C.2)
    micro_batch: int = 4  # sequences per forward/backward
    clip_low: float = 0.2
    clip_high: float = 0.28  # Clip-Higher (section 4.2; StarPO: 0.2)
    agg: str = "token-mean"
    entropy_coef: float = 0.001
    kl_coef: float = 0.0  # StarPO-S removes the KL (StarPO: 0.001)
    kl_kind: str = "k3"
    value_clip: float = 0.5
    max_grad_norm: float = 1.0
    temperature: float = 1.0  # log-probs at the sampling temperature
    dual_clip: float | None = None  # beyond the paper
    fused: bool = True  # engine/logprobs.py's chunked path
    chunk_size: int = 1024
    policy_loss: Callable | None = None  # `policy_loss`'s stand-in, same arguments (train.py's points)

    @classmethod
    def of(cls, cfg, policy_loss: Callable | None = None) -> "UpdateConfig":
        """train.py's Config (and its policy-loss point) -> the update's settings. A KL in the rewards (PPO as
        the paper ran StarPO) is only measured here, not a loss term."""
        kl_coef = 0.0 if cfg.kl_in_reward else cfg.kl_coef
        return cls(mini_batch=cfg.mini_batch, micro_batch=cfg.micro_batch, clip_low=cfg.clip_low,
                   clip_high=cfg.clip_high, agg=cfg.loss_agg, entropy_coef=cfg.entropy_coef,
                   kl_coef=kl_coef, kl_kind=cfg.kl_kind, value_clip=cfg.value_clip,
                   max_grad_norm=cfg.grad_clip, temperature=cfg.temperature,
                   dual_clip=cfg.dual_clip or None, fused=cfg.fused, policy_loss=policy_loss)


# ---- update

# update's metrics: token-weighted means, or means over its steps
TOKEN_METRICS = ("entropy", "pg_clipfrac", "pg_clipfrac_upper", "pg_clipfrac_lower", "approx_kl",
                 "kl_to_init", "vf_clipfrac")
PER_STEP = ("pg_loss", "grad_norm", "kl_loss", "value_loss", "critic_grad_norm")


def update(policy: nn.Module, optimizer: torch.optim.Optimizer, batch: Batch, cfg: UpdateConfig,
           critic: nn.Module | None = None, critic_optimizer: torch.optim.Optimizer | None = None,
           generator: torch.Generator | None = None, autocast_dtype: torch.dtype | None = None,
           shard: tuple[int, int] | None = None) -> dict[str, float]:
    """One pass of PPO/GRPO over `batch` (section 2.2) -> metrics: shuffled mini-batches, one optimizer step
    each (a non-finite loss or grad norm skips it). `batch.old_logp = None`: fresh rollouts in one
    mini-batch, ratio 1. `shard=(rank, world)` (torchrun): each rank trains every world-th row."""
    if critic is not None and (critic_optimizer is None or batch.returns is None or batch.old_values is None):
        raise ValueError("a critic needs a critic_optimizer, batch.returns and batch.old_values")
    check_dual_clip(cfg.dual_clip)
    rank, world = shard if shard is not None else (0, 1)
    check_shard(world, generator, policy, critic)
    device = next(policy.parameters()).device
    batch = batch.to(device)
    has_ref = batch.ref_logp is not None
    if batch.old_logp is None and len(batch) > cfg.mini_batch:
        raise ValueError("without old_logp the batch must fit one mini-batch: after a step the policy is no "
                         "longer the rollout policy")
    perm = torch.randperm(len(batch), generator=generator).to(device)
    optimizers = [optimizer] + ([critic_optimizer] if critic is not None else [])
    for o in optimizers:
        o.zero_grad(set_to_none=True)

    # over the steps taken: token-weighted sums, sums of PER_STEP
    keys = ["tokens", *TOKEN_METRICS, *(("pg_clipfrac_dual",) if cfg.dual_clip else ()), *PER_STEP]
    totals = {k: torch.zeros((), device=device) for k in keys}
    drift = torch.zeros(3, device=device)  # |old_logp - the sampler's|: sum, tokens, max
    steps_taken = skipped = 0

    for start in range(0, len(batch), cfg.mini_batch):
        mb = batch.select(perm[start:start + cfg.mini_batch])
        m = mb.loss_mask > 0
        tokens = m.sum().float()
        count = tokens if cfg.agg == "token-mean" else (m.sum(dim=1) > 0).sum().float()
        denom, token_denom = count.clamp(min=1) / world, tokens.clamp(min=1) / world
        step = {k: torch.zeros((), device=device) for k in keys}
        finite = torch.ones((), dtype=torch.bool, device=device)
        plan = micro_batches(len(mb), cfg.micro_batch, rank, world)
        for j, rows in enumerate(plan):
            # a rank out of rows runs a zero-weight row: DDP needs every rank
            mi = mb.select(rows) if rows else \
                dataclasses.replace(mb.select([0]), loss_mask=mb.loss_mask[:1] * 0)
            n_tok = (mi.loss_mask > 0).sum().float()
            with no_sync(policy, critic) if j < len(plan) - 1 else contextlib.nullcontext():
                with torch.autocast(device.type, autocast_dtype, enabled=autocast_dtype is not None):
                    logp, ent = token_logprobs(policy, mi.input_ids, mi.attention_mask, cfg.temperature,
                                               cfg.fused, cfg.chunk_size, prefix_len=mi.prefix_len)
                old_logp = mi.old_logp if mi.old_logp is not None else logp.detach()  # ratio 1
                if mi.rollout_logp is not None:  # the train-inference mismatch
                    drift = add_drift(drift, old_logp, mi.rollout_logp, mi.loss_mask)
                pg_loss = cfg.policy_loss or policy_loss  # an option's (GSPO's sequence ratios), or PPO's
                pg, pm = pg_loss(logp, old_logp, mi.advantages, mi.loss_mask, cfg.clip_low, cfg.clip_high,
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
                    if k in step:
                        step[k] += v * n_tok  # token means back to sums

                if critic is not None:
                    with torch.autocast(device.type, autocast_dtype, enabled=autocast_dtype is not None):
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
        if bool(all_ranks(finite, world)):  # the one host sync per step; the same decision on every rank
            for o in optimizers:
                o.step()
            for k in keys:
                totals[k] += step[k]
            steps_taken += 1
        else:
            skipped += 1
        for o in optimizers:
            o.zero_grad(set_to_none=True)

    stacked = sum_ranks(torch.stack([totals[k] for k in keys]), [k in PER_STEP for k in keys], world)
    host = dict(zip(keys, stacked.tolist()))  # one sync
    n_steps = steps_taken if steps_taken else math.nan
    n_tokens = host["tokens"] if host["tokens"] > 0 else math.nan
    absent = (set() if has_ref else {"kl_to_init", "kl_loss"}) | \
        (set() if critic is not None else {"value_loss", "vf_clipfrac", "critic_grad_norm"})
    return {**{f"train/{k}": host[k] / (n_steps if k in PER_STEP else n_tokens) for k in keys[1:]
               if k not in absent}, **drift_metrics(drift, world),
            "train/skipped_nonfinite": float(skipped), "train/optimizer_steps": float(steps_taken)}


def merge_passes(passes: list[dict]) -> dict:
    """The metrics of several passes of `update` over one batch (--ppo-epochs): counts summed, the rest
    averaged."""
    merged = {}
    for key in passes[0]:
        values = [p[key] for p in passes]
        counted = key in ("train/optimizer_steps", "train/skipped_nonfinite")
        merged[key] = sum(values) if counted else statistics.fmean(values)
    return merged
