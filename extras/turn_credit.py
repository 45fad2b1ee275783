"""Turn-level credit, beyond the paper (RAGEN's later code): each turn's reward on its own last reply token
(`--turn-rewards`, RAGEN's `use_turn_scores`) and bi-level GAE (`--bi-level-gae`, RAGEN HEAD's
compute_bi_level_gae_advantage_return in ragen/trainer/core_algos.py), both PPO only.

Turn ends are the positions the rollout recorded (`Segment.reply_ends`), as the loss mask is. RAGEN finds them
as the tokens with a non-zero reward, so a turn whose reward is 0 merges into the next and a row whose last
sampled token has no reward crashes its loop; where the turn ends are exactly those tokens the two agree
(tested). RAGEN's own train.py refuses the two options together ("not correctly supported yet"), so as RAGEN
runs bi-level GAE its loop sees one turn and the result is plain GAE (the one-turn identity, tested). The
returned advantages are unwhitened (RAGEN whitens inside; train.py whitens, as for `gae`), 0 outside the mask,
returns = advantages + values. Read after advantages.py.
"""
from __future__ import annotations

import torch

from advantages import gae, kl_penalized_rewards, place_reward_on_last_token, register, whiten
from starpo import masked_mean


def at_positions(values: list[list[float]], positions: list[list[int]], T: int) -> torch.Tensor:
    """[B, T] zeros with values[b][k] at column positions[b][k]: each turn's reward (or a 1) on its last reply
    token, at the positions the rollout recorded (Segment.reply_ends)."""
    out = torch.zeros(len(values), T)
    for b, (v, p) in enumerate(zip(values, positions)):
        out[b, p] = torch.tensor(v, dtype=out.dtype)
    return out


def bi_level_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                 turn_ends: torch.Tensor, gamma: float = 1.0, lam: float = 1.0,
                 high_level_gamma: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """RAGEN's bi-level GAE: a turn-level GAE over the turns of a trajectory, then a token-level GAE inside
    each turn (turn ends given, advantages unwhitened: the module docstring).

    token_rewards, values, mask: [B, T] as for `gae`, each turn's reward on its last reply token (a turn-level
    reward); turn_ends: [B, T] bool, True on the last sampled token of every turn (a subset of the mask that
    includes each row's last sampled token). With turn ends e_1 < ... < e_K of a row:
      turn level (high_level_gamma, lam):
        delta_k = r[e_k] + high_level_gamma * V[e_{k+1}] - V[e_k] (V[e_{K+1}] = 0),
        A[e_k] = delta_k + high_level_gamma * lam * A[e_{k+1}];
      token level (gamma, lam), restarting at every turn end: the turn end keeps A[e_k] (its reward replaced
        by the turn-level return A[e_k] + V[e_k], with nothing after it); any other sampled token t, whose
        next sampled token is t', gets delta_t = r[t] + gamma * V[t'] - V[t],
        A[t] = delta_t + gamma * lam * A[t'].
    One turn: high_level_gamma never enters and the result is `gae` (tested).
    Returns (advantages [B, T], 0 outside the mask, returns = advantages + values), unwhitened.
    """
    sampled = mask > 0  # [B, T]
    ends = turn_ends.bool()  # [B, T]
    if ends.shape != mask.shape:
        raise ValueError(f"turn_ends must have the mask's shape {tuple(mask.shape)}, got {tuple(ends.shape)}")
    if bool((ends & ~sampled).any()):
        raise ValueError("turn_ends marks a token outside mask; a turn ends on its last sampled token")
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # [B, T]
    if bool((torch.where(sampled, positions, -1).amax(dim=1)
             != torch.where(ends, positions, -1).amax(dim=1)).any()):
        raise ValueError("each row's last sampled token must be a turn end (turn_ends), or tokens would be "
                         "left outside every turn")
    if bool(((token_rewards != 0) & ~sampled).any()):
        raise ValueError("token_rewards has non-zero entries outside mask; rewards must sit on sampled "
                         "tokens")
    with torch.no_grad():
        rewards = token_rewards.float()
        vals = values.float()
        B, T = mask.shape
        zeros = torch.zeros(B, device=mask.device)
        # one backward sweep does both levels: a turn end needs only later turn ends, a token only later
        # tokens
        next_end_value, running_turn = zeros, zeros  # [B] V and A at the next turn end (turn level)
        next_value, running = zeros, zeros  # [B] V and A at the next sampled token (token level)
        advantages = torch.zeros(B, T, device=mask.device)  # [B, T]
        for t in reversed(range(T)):
            turn_adv = rewards[:, t] + high_level_gamma * next_end_value - vals[:, t] \
                + high_level_gamma * lam * running_turn  # [B] if t ends a turn
            # [B] otherwise
            token_adv = rewards[:, t] + gamma * next_value - vals[:, t] + gamma * lam * running
            end, on = ends[:, t], sampled[:, t]
            adv_t = torch.where(end, turn_adv, token_adv)
            running_turn = torch.where(end, turn_adv, running_turn)
            next_end_value = torch.where(end, vals[:, t], next_end_value)
            # where, not arithmetic: a non-finite value on a skipped token must not leak into the chain
            running = torch.where(on, adv_t, running)
            next_value = torch.where(on, vals[:, t], next_value)
            advantages[:, t] = torch.where(on, adv_t, 0.0)
        returns = advantages + vals
    return advantages, returns


def turn_credit(rows: list, rewards: torch.Tensor, cfg, T: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """train.py's PPO branch with `--turn-rewards` / `--bi-level-gae`. rows: (segment, trajectory) per batch
    row; rewards [B, T]: the trajectory reward on each row's last sampled token (replaced by each turn's own
    reward on its end with --turn-rewards). -> (token rewards [B, T], turn ends [B, T] bool for bi_level_gae,
    or None)."""
    ends = [s.reply_ends for s, _ in rows]  # [B] lists: each turn's last sampled token, from the rollout
    if cfg.turn_rewards:
        turn_r = [[u.reward for u in t.turns[:len(e)]] for (_, t), e in zip(rows, ends)]
        rewards = at_positions(turn_r, ends, T).to(rewards.device)
    if not cfg.bi_level_gae:
        return rewards, None
    return rewards, at_positions([[1.0] * len(e) for e in ends], ends, T).to(rewards.device) > 0


# ---- train.py's --turn-rewards / --bi-level-gae, plugged into its loop

def plug(cfg, points: dict, run: dict) -> None:
    """PPO's estimator with turn credit replaces advantages.ppo (the options' rules: PPO only)."""
    points["estimator"] = ppo_turn_credit


@register(None, needs_critic=True, signal_without_spread=True)  # PPO's: the critic learns from any batch
def ppo_turn_credit(kept, rows, batch, cfg):
    """advantages.ppo with `turn_credit`'s token rewards and, with --bi-level-gae, `bi_level_gae`."""
    mask = batch.loss_mask
    rewards = place_reward_on_last_token(torch.tensor([t.reward for _, t in rows]).to(mask.device), mask)
    rewards, ends = turn_credit(rows, rewards, cfg, mask.shape[1])
    metrics = {}
    if cfg.kl_in_reward:  # StarPO with PPO as the paper ran it (RAGEN's apply_kl_penalty)
        rewards = kl_penalized_rewards(rewards, batch.old_logp, batch.ref_logp, mask, cfg.kl_coef)
        metrics["train/kl_in_reward"] = masked_mean(batch.old_logp - batch.ref_logp, mask).item()
    if ends is None:
        advantages, returns = gae(rewards, batch.old_values, mask, cfg.gamma, cfg.lam)
    else:
        advantages, returns = bi_level_gae(rewards, batch.old_values, mask, ends, cfg.gamma, cfg.lam,
                                           cfg.high_level_gamma)
    return whiten(advantages, mask), returns, metrics
