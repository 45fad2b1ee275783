"""Advantages for StarPO: where the trajectory reward sits, GAE (PPO) and group-normalised scores (GRPO).

Paper: RAGEN, section 2.2 (StarPO). The objective is trajectory-level, J = E_{M, tau ~ pi}[R(tau)]: one whole
multi-turn interaction (prompt, every reply, every environment message) is one training sequence, and PPO and
GRPO differ only in how that sequence's token-level advantage is estimated. Appendix A describes the PPO critic
and GAE, Appendix C.2 the settings gamma = lambda = 1.

Token convention shared by every file: a row of a [B, T] tensor holds one whole trajectory, right-padded, and
`mask[:, t] == 1` exactly on the tokens the policy sampled (replies), 0 on prompt, environment messages and
padding. The mask comes from positions recorded during the rollout, never from token ids.

Deliberate deviations from the paper / RAGEN (which uses verl's estimators):
1. `gae` zeroes the advantage outside the mask (verl carries the running value there; those tokens never enter a
   loss, so this only makes the tensors readable), so there `returns == values`.
2. `gae` raises ValueError when a reward sits on a token outside the mask; verl silently drops it. Use
   `place_reward_on_last_token`, which always puts the reward on a sampled token.
3. `grpo_advantages` gives 0 to a group of one (verl divides such a score by 1 + eps, i.e. the raw score is the
   advantage); with no group-mates there is no baseline, so no learning signal is the honest answer.
4. `whiten` zeroes the output outside the mask (verl leaves whitened junk there) and needs at least two sampled
   tokens (the unbiased variance, as in verl's masked_whiten, is undefined for one).
5. `bi_level_gae` (RAGEN's compute_bi_level_gae_advantage_return, ragen/trainer/core_algos.py) takes each turn's
   end as given (`turn_ends`, from positions, as the mask is). RAGEN finds turn ends as the tokens with a non-zero
   reward, so a turn whose reward is 0 is merged into the next one, and a row whose last sampled token has no
   reward crashes its loop. Where the turn ends are exactly RAGEN's non-zero-reward tokens the two agree (tested).
   A reward on a sampled token that ends no turn (e.g. a per-token KL penalty) enters the token-level TD error
   of that token only, as RAGEN's token-level loop reads it; RAGEN would make that token a turn end.
   RAGEN's own train.py (HEAD) refuses bi_level_gae with per-turn scores (`use_turn_scores`, "not correctly
   supported yet"), so as RAGEN runs it the whole reward sits on the last token, its loop sees one turn (if that
   reward is non-zero) and the result is plain GAE (the one-turn identity, tested); here per-turn rewards are
   the point.
6. `bi_level_gae` returns unwhitened advantages (RAGEN whitens inside; `whiten` is separate here, as for `gae`),
   0 outside the mask and `returns = advantages + values` (RAGEN: returns 0 outside the mask), as `gae` does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def at_positions(values: list[list[float]], positions: list[list[int]], T: int) -> torch.Tensor:
    """[B, T] zeros with values[b][k] at column positions[b][k]: each turn's reward (or a 1) on its last reply
    token, at the positions the rollout recorded (Segment.reply_ends)."""
    out = torch.zeros(len(values), T)
    for b, (v, p) in enumerate(zip(values, positions)):
        out[b, p] = torch.tensor(v, dtype=out.dtype)
    return out


def place_reward_on_last_token(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put each trajectory's total reward on its last sampled token, 0 elsewhere (section 2.2: J = E[R(tau)]).

    scores: [B] total reward of each trajectory (env rewards + format penalties); mask: [B, T].
    A row with no sampled token gets all zeros (its reward cannot be credited to any action).
    """
    sampled = mask > 0  # [B, T]
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)  # [B, T]
    last = torch.where(sampled, positions, -1).amax(dim=1)  # [B], -1 for an all-masked row
    dtype = scores.dtype if scores.is_floating_point() else torch.float32
    values = torch.where(last >= 0, scores.to(dtype), 0.0)  # [B]
    # scatter instead of boolean indexing: no host sync, and all-masked rows write a 0 to column 0
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).scatter_(1, last.clamp(min=0).unsqueeze(1),
                                                                             values.unsqueeze(1))  # [B, T]


def kl_penalized_rewards(token_rewards: torch.Tensor, old_logp: torch.Tensor, ref_logp: torch.Tensor,
                         mask: torch.Tensor, coef: float) -> torch.Tensor:
    """StarPO's KL for PPO as the paper ran it (RAGEN's apply_kl_penalty with `kl_penalty: kl`): every trained token
    pays coef x (old_logp - ref_logp), the k1 estimate of KL(pi_old || pi_ref), in its reward; GAE then spreads
    it. All [B, T]; 0 outside the mask."""
    return token_rewards - coef * torch.where(mask > 0, old_logp.float() - ref_logp.float(), 0.0)


def gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float = 1.0,
        lam: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over the sampled tokens of multi-turn sequences (Appendix A).

    token_rewards, values, mask: [B, T]; values[:, t] is the critic's value of the state just before token t.
    Tokens outside the mask are skipped: their value and TD error do not enter the recursion, so the chain runs
    from the last reply token of one turn straight to the first reply token of the next, across the environment
    message in between. After a row's last sampled token the next value is 0 (the episode ended).
    Returns (advantages [B, T], returns = advantages + values [B, T]); whitening is separate (`whiten`), as in verl.
    """
    sampled = mask > 0  # [B, T]
    if bool(((token_rewards != 0) & ~sampled).any()):
        raise ValueError("token_rewards has non-zero entries outside mask; rewards must sit on sampled tokens "
                         "(see place_reward_on_last_token)")
    with torch.no_grad():
        rewards = token_rewards.float()
        vals = values.float()
        B, T = mask.shape
        next_value = torch.zeros(B, device=mask.device)  # [B] value of the next sampled token's state
        running = torch.zeros(B, device=mask.device)  # [B] advantage of the next sampled token
        advantages = torch.zeros(B, T, device=mask.device)  # [B, T]
        for t in reversed(range(T)):
            delta = rewards[:, t] + gamma * next_value - vals[:, t]  # [B]
            adv_t = delta + gamma * lam * running  # [B]
            on = sampled[:, t]  # [B]
            # where, not arithmetic: a non-finite value on a skipped token must not leak into the chain
            running = torch.where(on, adv_t, running)
            next_value = torch.where(on, vals[:, t], next_value)
            advantages[:, t] = torch.where(on, adv_t, 0.0)
        returns = advantages + vals
    return advantages, returns


def bi_level_gae(token_rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, turn_ends: torch.Tensor,
                 gamma: float = 1.0, lam: float = 1.0,
                 high_level_gamma: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """RAGEN's bi-level GAE: a turn-level GAE over the turns of a trajectory, then a token-level GAE inside each
    turn (deviations 5 and 6).

    token_rewards, values, mask: [B, T] as for `gae`, each turn's reward on its last reply token (a turn-level
    reward); turn_ends: [B, T] bool, True on the last sampled token of every turn (a subset of the mask that
    includes each row's last sampled token). With turn ends e_1 < ... < e_K of a row:
      turn level (high_level_gamma, lam): delta_k = r[e_k] + high_level_gamma * V[e_{k+1}] - V[e_k] (V[e_{K+1}] = 0),
        A[e_k] = delta_k + high_level_gamma * lam * A[e_{k+1}];
      token level (gamma, lam), restarting at every turn end: the turn end keeps A[e_k] (its reward replaced by the
        turn-level return A[e_k] + V[e_k], with nothing after it); any other sampled token t, whose next sampled
        token is t', gets delta_t = r[t] + gamma * V[t'] - V[t], A[t] = delta_t + gamma * lam * A[t'].
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
    if bool((torch.where(sampled, positions, -1).amax(dim=1) != torch.where(ends, positions, -1).amax(dim=1)).any()):
        raise ValueError("each row's last sampled token must be a turn end (turn_ends), or tokens would be left "
                         "outside every turn")
    if bool(((token_rewards != 0) & ~sampled).any()):
        raise ValueError("token_rewards has non-zero entries outside mask; rewards must sit on sampled tokens")
    with torch.no_grad():
        rewards = token_rewards.float()
        vals = values.float()
        B, T = mask.shape
        zeros = torch.zeros(B, device=mask.device)
        # one backward sweep does both levels: a turn end needs only later turn ends, a token only later tokens
        next_end_value, running_turn = zeros, zeros  # [B] V and A at the next turn end (turn level)
        next_value, running = zeros, zeros  # [B] V and A at the next sampled token (token level)
        advantages = torch.zeros(B, T, device=mask.device)  # [B, T]
        for t in reversed(range(T)):
            turn_adv = rewards[:, t] + high_level_gamma * next_end_value - vals[:, t] \
                + high_level_gamma * lam * running_turn  # [B] if t ends a turn
            token_adv = rewards[:, t] + gamma * next_value - vals[:, t] + gamma * lam * running  # [B] otherwise
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


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Masked whitening over the whole batch: mean 0, std 1 over the tokens where mask == 1 (as verl does for
    PPO advantages). Unbiased variance, x' = (x - mean) / sqrt(var + eps); 0 outside the mask."""
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
    """GRPO's critic-free advantage (section 2.2): (score - group mean) / (group std + eps).

    scores: [B] trajectory rewards; group_ids: [B] (tensor of ints, or any sequence of hashables) marking the
    rollouts of the same prompt. Std is the unbiased (Bessel-corrected) one, as verl/RAGEN compute it. A group
    of one gets 0 (deviation 3 in the module docstring). `norm_by_std=False` is Dr.GRPO's mean-only version.
    Returns [B]; use `broadcast_to_tokens` to spread it over each trajectory's sampled tokens.
    """
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
    """Spread one advantage per trajectory [B] over its sampled tokens: adv[:, None] * mask -> [B, T]."""
    return adv.float().unsqueeze(1) * mask.float()
