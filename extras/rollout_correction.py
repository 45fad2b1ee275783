"""Train-inference mismatch correction, beyond the paper: train.py's `--rollout-correction {tis,mask}`.

The rollout samples with the engine (bf16 weight copies on a GPU, and on a CPU with `--dtype bf16`), the
update recomputes the same tokens' log-probs in its own path: the two differ (`rollout/logp_diff_*` measures
it), so the update's "old" policy is not exactly the one that sampled. verl (docs/algo/rollout_corr.md), TRL
(on by default with vLLM) and SkyRL correct for it with rho_t = exp(old_logp_t - rollout_logp_t) per token:

- `tis`, truncated importance sampling (verl's token-level `rollout_is`, TRL's default): every token's
  policy-gradient term weighted by w_t = min(rho_t, C), C = --rollout-correction-cap (verl, TRL: 2), the
  weight a constant (no gradient through it);
- `mask`, a sequence-level geometric mask (SkyRL's `geometric`, prime-rl's geo mask): a row whose geometric
  mean ratio exp(mean_t log rho_t) leaves [1/C, C] is dropped from the loss (its tokens leave the mask, and so
  every denominator). SkyRL's runs use a tight band (C = 1.01), prime-rl a wide one (10).
Applied to the batch once it is built (train.py's `after_batch` point): the weight multiplies the advantages,
which is the same as weighting the clipped per-token loss since w >= 0. Tokens without a sampler's log-prob
(scripted replies, or every token after the system prompt with --no-response-mask) keep weight 1.
"""
from __future__ import annotations

import torch

MODES = ("none", "tis", "mask")


def log_ratios(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor):
    """-> (log rho [B, T], 0 where unseen; seen [B, T]: trained tokens with a recorded sampled log-prob)."""
    seen = (mask > 0) & torch.isfinite(rollout_logp)
    return torch.where(seen, old_logp.float() - rollout_logp.float(), 0.0), seen


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                cap: float) -> tuple[torch.Tensor, dict]:
    """Truncated IS: w = min(exp(old - rollout), cap) on the seen tokens, 1 elsewhere, [B, T]; -> (w, metrics:
    the weights' mean and max over seen tokens, the share truncated at the cap)."""
    log_rho, seen = log_ratios(old_logp, rollout_logp, mask)
    rho = torch.exp(log_rho)
    w = torch.where(seen, rho.clamp(max=cap), 1.0)
    n = seen.sum().clamp(min=1)
    metrics = {"train/is_weight_mean": (torch.where(seen, w, 0.0).sum() / n).item(),
               "train/is_weight_max": torch.where(seen, w, 0.0).max().item(),
               "train/is_truncated": ((rho > cap) & seen).sum().item() / n.item()}
    return w, metrics


def geometric_keep(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                   cap: float) -> tuple[torch.Tensor, dict]:
    """The geometric mask: keep [B] bool, False for a row whose exp(mean log rho) over its seen tokens lies
    outside [1/cap, cap] (a row with none seen is kept); -> (keep, metrics: the rows and tokens masked, the
    geometric means' mean)."""
    log_rho, seen = log_ratios(old_logp, rollout_logp, mask)
    count = seen.sum(dim=1)  # [B]
    geo = torch.exp(log_rho.sum(dim=1) / count.clamp(min=1))  # [B]
    keep = (count == 0) | ((geo >= 1.0 / cap) & (geo <= cap))
    rows_seen = (count > 0).sum().clamp(min=1)
    metrics = {"train/is_masked_rows": (~keep).sum().item() / len(keep),
               "train/is_masked_tokens": ((mask > 0) & ~keep.unsqueeze(1)).sum().item()
               / max(1, int((mask > 0).sum())),
               "train/is_geo_mean": (torch.where(count > 0, geo, 0.0).sum() / rows_seen).item()}
    return keep, metrics


def correct(batch, mode: str, cap: float) -> dict:
    """Apply `mode` to a built batch (starpo.Batch with old_logp and rollout_logp): tis reweights its
    advantages, mask drops rows from its loss mask. -> metrics."""
    old = batch.old_logp  # train.py computes it for a run with an after_batch hook
    if mode == "tis":
        w, metrics = tis_weights(old, batch.rollout_logp, batch.loss_mask, cap)
        batch.advantages = batch.advantages * w
        return metrics
    keep, metrics = geometric_keep(old, batch.rollout_logp, batch.loss_mask, cap)
    batch.loss_mask = batch.loss_mask * keep.unsqueeze(1).to(batch.loss_mask.dtype)
    return metrics


def plug(cfg, points: dict, run: dict) -> None:
    """train.py's --rollout-correction: a hook after the batch is built (which also makes train.py compute
    the old log-probs it reads, where one optimizer step would skip them)."""
    def hook(batch, metrics: dict) -> None:
        metrics.update(correct(batch, cfg.rollout_correction, cfg.rollout_correction_cap))
    points["after_batch"].append(hook)
