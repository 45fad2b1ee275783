"""Sequence-level ratios (GSPO, Zheng et al. 2025, arXiv 2507.18071), beyond the paper: train.py's
`--ratio-level sequence`, as verl-agent and TRL (`importance_sampling_level="sequence"`) have it.

StarPO's loss (starpo.policy_loss) clips each token's ratio pi / pi_old. GSPO clips one ratio per row, the
geometric mean of its tokens' ratios, s_i = exp(mean over the row's sampled tokens of (logp - old_logp)), and
gives every token of the row that ratio: loss_t = max(-A_t s_i, -A_t clip(s_i, 1 - eps_low, 1 + eps_high)),
aggregated as the token loss is (--loss-agg). Its ratios are near 1, so its epsilons are small: the paper's
3e-4 and 4e-4 (--gspo-clip-low, --gspo-clip-high), in place of --clip-low / --clip-high. The gradient of s_i
reaches every token of the row through the mean, as in TRL (GSPO's own "GSPO-token" form equals it when the
advantage is the row's, as GRPO's). At ratio 1 it is the token loss: the same value, and the same gradient
for a row-constant advantage (tested).
"""
from __future__ import annotations

import torch

from starpo import LOG_RATIO_CLAMP, aggregate, check_dual_clip, masked_mean


def sequence_ratios(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """s_i for each row, broadcast to its tokens [B, T]: exp of the mean log-ratio over the row's trained
    tokens (1 for a row with none)."""
    m = mask > 0
    old = torch.where(m, old_logp.float(), logp.detach().float())
    log_ratio = torch.where(m, logp.float() - old, 0.0)  # [B, T]
    mean = log_ratio.sum(dim=1) / m.sum(dim=1).clamp(min=1)  # [B]
    return torch.exp(mean.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)).unsqueeze(1).expand_as(logp)  # [B, T]


def sequence_policy_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor,
                         mask: torch.Tensor, clip_low: float = 3e-4, clip_high: float = 4e-4,
                         agg: str = "token-mean", denom: torch.Tensor | float | None = None,
                         dual_clip: float | None = None) -> tuple[torch.Tensor, dict]:
    """GSPO's clipped surrogate with starpo.policy_loss's arguments and metrics (the module docstring); the
    clip bounds are GSPO's epsilons. Dual clip as in policy_loss."""
    check_dual_clip(dual_clip)
    m = mask > 0
    adv = torch.where(m, advantages.float(), 0.0)
    ratio = sequence_ratios(logp, old_logp, mask)  # [B, T]
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_tok = torch.maximum(unclipped, clipped)
    dual = torch.zeros_like(m)
    if dual_clip:
        cap = -adv * dual_clip
        dual = (adv < 0) & (loss_tok > cap)
        loss_tok = torch.where(adv < 0, torch.minimum(cap, loss_tok), loss_tok)
    log_ratio = torch.log(ratio.detach())
    metrics = {
        "pg_clipfrac": masked_mean((clipped > unclipped).float(), mask),
        "pg_clipfrac_upper": masked_mean(((adv > 0) & (ratio > 1.0 + clip_high)).float(), mask),
        "pg_clipfrac_lower": masked_mean(((adv < 0) & (ratio < 1.0 - clip_low)).float(), mask),
        "pg_clipfrac_dual": masked_mean(dual.float(), mask),
        "approx_kl": masked_mean(-log_ratio, mask),
    }
    return aggregate(loss_tok, mask, agg, denom), metrics


def plug(cfg, points: dict, run: dict) -> None:
    """train.py's --ratio-level sequence: GSPO's loss at the policy-loss point, with its own epsilons."""
    def loss(logp, old_logp, advantages, mask, clip_low, clip_high, agg="token-mean", denom=None,
             dual_clip=None):
        return sequence_policy_loss(logp, old_logp, advantages, mask, cfg.gspo_clip_low, cfg.gspo_clip_high,
                                    agg, denom, dual_clip)
    points["policy_loss"] = loss
