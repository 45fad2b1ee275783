"""Advantages for StarPO (paper section 2.2, Appendix A): GRPO's group-normalised scores, PPO's GAE.

The objective is trajectory-level, J = E[R(tau)]: PPO and GRPO differ only in how a token's advantage is
estimated (Appendix C.2: gamma = lambda = 1). A row of a [B, T] tensor is one trajectory, right-padded;
`mask[:, t] == 1` exactly on the tokens the policy sampled. At the end, the estimators by name
(`ESTIMATORS`, train.py's --algo): add one with `@register("name")`. Next: starpo.py, where they meet the
loss.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence

import torch

from starpo import masked_mean


def place_reward_on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Each reward scores [B] on its row's last sampled token, 0 elsewhere -> [B, T]."""
    sampled = mask > 0  # [B, T]
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # [B, T]
    last = torch.where(sampled, positions, -1).amax(dim=1)  # [B], -1 for an all-masked row
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    values = torch.where(last >= 0, scores.to(dtype), 0.0)  # [B]
    out = torch.zeros(mask.shape, dtype=dtype, device=mask.device)
    return out.scatter_(1, last.clamp(min=0).unsqueeze(1), values.unsqueeze(1))  # [B, T]


def kl_penalized_rewards(token_rewards: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
                         mask: torch.Tensor, coef: float) -> torch.Tensor:
    """StarPO's KL for PPO as the paper ran it (RAGEN's apply_kl_penalty): each trained token's reward pays
    coef x the k1 estimate (old_logp - ref_logp). All [B, T]."""
    return token_rewards - coef * torch.where(mask > 0, old_logp.float() - ref_logp.float(), 0.0)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """GAE (Appendix A) over the sampled tokens, all [B, T]; the chain skips tokens off the mask (from a
    turn's last reply token to the next turn's first). -> (advantages, returns = advantages + values)."""
    sampled = mask > 0  # [B, T]
    if bool(((token_rewards != 0) & ~sampled).any()):
        raise ValueError("token_rewards has non-zero entries outside mask; rewards must sit on sampled "
                         "tokens (see place_reward_on_last_token)")
    with torch.no_grad():
        rewards, vals = token_rewards.float(), values.float()
        B, T = mask.shape
        next_value = torch.zeros(B, device=mask.device)  # [B] the next sampled token's value
        running = torch.zeros(B, device=mask.device)  # [B] its advantage
        advantages = torch.zeros(B, T, device=mask.device)  # [B, T]
        for t in reversed(range(T)):
            delta = rewards[:, t] + gamma * next_value - vals[:, t]  # [B]
            adv_t = delta + gamma * lam * running  # [B]
            on = sampled[:, t]  # [B]
            # where, not arithmetic: a non-finite value off the mask must not leak into the chain
            running = torch.where(on, adv_t, running)
            next_value = torch.where(on, vals[:, t], next_value)
            advantages[:, t] = torch.where(on, adv_t, 0.0)
        returns = advantages + vals
    return advantages, returns


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """verl's whitening: mean 0, std 1 (unbiased) on the mask, 0 off it."""
    sampled = mask > 0
    count = int(sampled.sum())
    if count < 2:
        raise ValueError(f"whiten needs at least 2 tokens with mask == 1, got {count}")
    xs = torch.where(sampled, x.float(), 0.0)
    mean = xs.sum() / count
    var = (torch.where(sampled, x.float() - mean, 0.0) ** 2).sum() / (count - 1)  # unbiased, as verl
    return torch.where(sampled, (x.float() - mean) * torch.rsqrt(var + eps), 0.0)


def grpo_advantages(scores: torch.Tensor, group_ids: torch.Tensor | Sequence, eps: float = 1e-6,
                    norm_by_std: bool = True) -> torch.Tensor:
    """GRPO's critic-free advantage (section 2.2): (score - group mean) / (unbiased group std + eps). scores
    [B], group_ids [B] (hashables). A group of one: 0 (verl: its raw score). norm_by_std=False: Dr.GRPO."""
    if isinstance(group_ids, torch.Tensor):
        _, inverse = torch.unique(group_ids.to(scores.device), return_inverse=True)  # [B] in 0..G-1
    else:
        index_of: dict = {}
        inverse = torch.tensor([index_of.setdefault(g, len(index_of)) for g in group_ids], dtype=torch.long,
                               device=scores.device)
    if scores.shape[0] == 0:
        return scores.float().clone()
    s = scores.float()
    G = int(inverse.max()) + 1
    count = torch.zeros(G, device=s.device).index_add_(0, inverse, torch.ones_like(s))  # [G]
    mean = torch.zeros(G, device=s.device).index_add_(0, inverse, s) / count  # [G]
    adv = s - mean[inverse]  # [B] centred
    if norm_by_std:
        sq = torch.zeros(G, device=s.device).index_add_(0, inverse, adv ** 2)  # [G]
        adv = adv / (torch.sqrt(sq / (count - 1).clamp(min=1))[inverse] + eps)  # unbiased std
    return torch.where(count[inverse] > 1, adv, 0.0)


def broadcast_to_tokens(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One advantage per row [B] on its sampled tokens -> [B, T]."""
    return adv.float().unsqueeze(1) * mask.float()


# ---- the estimators by name: train.py's --algo NAME calls ESTIMATORS[NAME]

ESTIMATORS: dict = {}  # name -> estimator; a str: the module that registers it, imported on first use


def register(name: str | None, needs_critic: bool = False, signal_without_spread=False):
    """A decorator: put an estimator into ESTIMATORS under `name` (None: only give it the attributes, for
    an estimator an option plugs in itself). An estimator is one function,

        fn(kept, rows, batch, cfg) -> (advantages [B, T], returns [B, T] or None, metrics dict)

    kept: the trajectories the filter kept (rollout.Trajectory); rows: (segment, its trajectory) for each row
    of `batch` (starpo.Batch, advantages still None: loss_mask, and old_values when it needs a critic); cfg:
    train.py's Config. Its attributes: `needs_critic` (train.py builds and trains PPO's value model and fills
    batch.old_values and returns), and `signal_without_spread`: whether a batch in which every group's
    rollouts got one reward still teaches (False: train.py logs and skips the update), or a function
    (kept, cfg) -> bool that decides it per batch."""
    def add(fn):
        fn.needs_critic = needs_critic
        fn.signal_without_spread = signal_without_spread
        if name is not None:
            ESTIMATORS[name] = fn
        return fn
    return add


def estimator(name: str):
    """ESTIMATORS[name]; an option beyond the paper (its entry a module's name) is imported first."""
    if isinstance(ESTIMATORS[name], str):
        importlib.import_module(ESTIMATORS[name])  # registers itself, replacing the entry
    return ESTIMATORS[name]


def has_signal(fn, kept, cfg) -> bool:
    """Whether estimator `fn` learns from a batch whose every group has zero reward std."""
    if callable(fn.signal_without_spread):
        return fn.signal_without_spread(kept, cfg)
    return bool(fn.signal_without_spread)


@register("grpo")
def grpo(kept, rows, batch, cfg):
    """GRPO (section 2.2): each trajectory's group-normalised reward on every token it sampled."""
    rewards = torch.tensor([t.reward for t in kept])  # [K]
    scores = grpo_advantages(rewards, [t.group_id for t in kept], norm_by_std=cfg.grpo_std_norm)  # [K]
    segments = torch.tensor([len(t.segments) for t in kept])  # [K]: rows list each trajectory's in order
    row_adv = scores.repeat_interleave(segments)  # [B]
    return broadcast_to_tokens(row_adv.to(batch.loss_mask.device), batch.loss_mask), None, {}


@register("ppo", needs_critic=True, signal_without_spread=True)  # the critic learns from any batch
def ppo(kept, rows, batch, cfg):
    """PPO (Appendix A): the trajectory's reward on each row's last sampled token, the KL there too when the
    paper's StarPO puts it in the rewards, GAE with the critic's values, whitened over the batch (verl)."""
    mask = batch.loss_mask
    rewards = place_reward_on_last_token(torch.tensor([t.reward for _, t in rows]).to(mask.device), mask)
    metrics = {}
    if cfg.kl_in_reward:  # RAGEN's apply_kl_penalty
        rewards = kl_penalized_rewards(rewards, batch.old_logp, batch.ref_logp, mask, cfg.kl_coef)
        metrics["train/kl_in_reward"] = masked_mean(batch.old_logp - batch.ref_logp, mask).item()
    advantages, returns = gae(rewards, batch.old_values, mask, cfg.gamma, cfg.lam)
    return whiten(advantages, mask), returns, metrics


ESTIMATORS["gigpo"] = "extras.gigpo"  # beyond the paper: verl-agent's GiGPO
