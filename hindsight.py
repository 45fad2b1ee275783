"""Hindsight imitation (GCSL), beyond the paper: `train.py --hindsight-imitation K`, off by default.

    python train.py --env sokoban --hindsight-imitation 3 --no-think --context-turns 1 --max-turns 10 \
        --max-actions-per-turn 1 --prompts 32 --rollouts 4          # the recipe: docs/results.md, "Hindsight"

Neither the paper nor RAGEN has it. From the tiny prior, StarPO-S alone does not learn Sokoban on a CPU (as the
paper found RL weak on Sokoban: 20.3% against SFT's 74.6%): most rollouts fail, and a group whose N rollouts all
fail has no reward spread and so no GRPO signal. GCSL (Ghosh et al. 2019, "Learning to Reach Goals via Iterated
Supervised Learning") turns every failed rollout into a success: a rollout that moved the box reached *some*
goal, the cell where it left the box. Relabelled with the target there, it is a demonstration, and the policy
imitates it for K supervised passes after each RL update, on its own AdamW.

Deviations (from GCSL as published, and choices of this codebase):
1. Only the loop-free turns of a rollout are demonstrated (`loop_free_turns`): bumps, steps back and loops are cut.
2. Replies are re-rendered from the parsed actions, as RAGEN's ctx_manager does (`scripted_reply`); with --think
   the sampled thought is replaced by one in the expert's words, true of the relabelled room (`demo_thoughts`).
3. The imitation step is `starpo.update` with advantage 1 on every trained token and ratio 1: its gradient is
   that of the mean NLL; no clip, no entropy bonus, no KL.
4. `--imitation-demos best` imitates instead each room's shortest solved rollout, unrelabelled (expert
   iteration): on the main command it stayed at the prior, but from the SFT policy it is what lifts (docs/results.md).
5. Removed after measuring: HER as GRPO groups (`--hindsight`, commit 504108b has it), which lifted nothing.
"""
from __future__ import annotations

import statistics
from dataclasses import replace

import torch

import distributed as dist
from envs import ENVS
from policy import pad_segments
from rollout import RolloutConfig, Segment, expert_thought, rollout, scripted_reply, trained_mask
from starpo import Batch, UpdateConfig, make_optimizer, shared_prefix_len, update


def supported(env: str) -> bool:
    """Relabelling needs an env whose goal can be moved (`reached_goal`, `set_goal`): Sokoban and its variants."""
    return hasattr(ENVS[env], "reached_goal")


def make_imitation_optimizer(policy, lr: float):
    """The imitation's own AdamW: a supervised step wants ~5x the RL step (betas as sft_baseline.py's tiny default)."""
    return make_optimizer(policy, lr, weight_decay=0.0, betas=(0.9, 0.95))


def loop_free_turns(env, traj) -> list[int]:
    """The turns of `traj` on its shortest way through the states it visited: a turn that leads back to a state the
    episode was in (a bump into a wall, a step back, a loop) is cut together with the turns in between. The actions
    are stepped again on `env`; a cut episode still ends in the same state."""
    env.reset(traj.seed)
    states = [env.render()]
    for turn in traj.turns:
        for a in turn.actions:
            if not env.done:
                env.step(a)
        states.append(env.render())
    last = {s: k for k, s in enumerate(states)}
    kept, k = [], 0
    while k < len(traj.turns):
        if last[states[k]] > k:
            k = last[states[k]]  # skip the loop
        else:
            kept.append(k)
            k += 1
    return kept



def demo_thoughts(sim, seed: int, goal, moves: list[list[str]]) -> list[str]:
    """With --think, each demo turn's thought in the expert's words (`expert_agent`), true of the replayed room: where
    things are with the target moved to `goal`, the first push the demo's moves make from there (`env.note`), the
    turn's moves. The sampled thought cannot stay: it read the original target, and a reading learned against a
    board that shows another one is a misreading. -> one thought per turn the replay plays."""
    sim.reset(seed)
    if goal is not None:
        sim.set_goal(goal)
    thoughts = []
    for j, turn in enumerate(moves):
        if sim.done:  # the relabelled target was reached on the way: the replay ends here
            break
        thoughts.append(expert_thought(sim.note([a for m in moves[j:] for a in m]), turn))
        for a in turn:
            if not sim.done:
                sim.step(a)
    return thoughts



def hindsight_demos(env: str, trajs: list, tok, rcfg: RolloutConfig, env_overrides: dict,
                    demos: str = "hindsight") -> list:
    """GCSL's data (Ghosh et al. 2019, "Learning to Reach Goals via Iterated Supervised Learning"): every rollout that
    moved the box is a demonstration of reaching where it left the box. It is replayed in its own room with the target
    moved there (a rollout that solved the room keeps its target): its loop-free turns only, each reply re-rendered
    from its parsed actions as RAGEN's ctx_manager does (`scripted_reply`, the answer format), with --think after a
    thought true of the replayed room (`demo_thoughts`). Every demo succeeds by construction; no model runs.
    `demos="best"` (`--imitation-demos best`, the RL-from-SFT recipe): only each room's solved rollout of the fewest
    actions, in its own room (expert iteration, Anthony et al. 2017: the best of N samples beats one sample)."""
    sim = ENVS[env](**env_overrides)
    if demos == "best":
        best = {}
        for t in trajs:
            if t.success and (t.group_id not in best or t.num_actions < best[t.group_id].num_actions):
                best[t.group_id] = t
        trajs = list(best.values())
    seeds, goals, replies = [], [], []
    for t in trajs:
        if t.reached_goal is None and not t.success:  # the box never moved, or ended where it began
            continue
        turns = loop_free_turns(sim, t)
        if not turns:
            continue
        goal = None if t.success else t.reached_goal
        moves = [t.turns[k].actions for k in turns]
        thoughts = demo_thoughts(sim, t.seed, goal, moves) if rcfg.think else [""] * len(moves)
        seeds.append(t.seed)
        goals.append(goal)
        replies.append([tok(scripted_reply(m, th, rcfg), add_special_tokens=False).input_ids
                        for m, th in zip(moves, thoughts)])
    if not seeds:
        return []
    replays = rollout(env, seeds, list(range(len(seeds))), rcfg, tokenizer=tok, replies=replies, goals=goals,
                      env_overrides=env_overrides)
    return [d for d in replays if d.success]



def imitate(demos: list, passes: int, policy, opt, ucfg: UpdateConfig, pad_id: int, response_mask: bool,
            gen: torch.Generator, amp) -> dict:
    """`passes` of supervised learning on the demos' replies: each mini-batch is one `update`
    with advantage 1 on every trained token and the ratio exactly 1 (no old log-probs), whose gradient is that of
    the mean negative log-likelihood, -grad log p: no clip, no entropy bonus, no KL. -> metrics."""
    rows = [Segment(s.input_ids, trained_mask(s, response_mask)) for d in demos for s in d.segments]
    m = {"imitation/demos": float(len(demos)), "imitation/rows": float(len(rows)), "imitation/optimizer_steps": 0.0}
    if not rows:
        return m
    ids, attn, mask = pad_segments(rows, pad_id)  # [B, T] each
    data = Batch(input_ids=ids, attention_mask=attn, loss_mask=mask, advantages=mask.float(),
                 prefix_len=shared_prefix_len([r.input_ids for r in rows]))
    icfg = replace(ucfg, entropy_coef=0.0, kl_coef=0.0)
    entropies = []
    for _ in range(passes):
        perm = torch.randperm(len(rows), generator=gen)
        for start in range(0, len(rows), ucfg.mini_batch):
            um = update(policy, opt, data.select(perm[start:start + ucfg.mini_batch]), icfg, generator=gen,
                        autocast_dtype=amp, shard=(dist.rank(), dist.world_size()))
            m["imitation/optimizer_steps"] += um["train/optimizer_steps"]
            entropies.append(um["train/entropy"])
    m["imitation/entropy"] = statistics.fmean(entropies)  # of the demos' tokens, before each step
    return m


def imitation_step(env: str, trajs: list, passes: int, demos: str, policy, opt, ucfg: UpdateConfig, tok,
                   rcfg: RolloutConfig, env_overrides: dict, response_mask: bool, gen: torch.Generator, amp) -> dict:
    """One iteration's imitation: the demos of its rollouts (`hindsight_demos`), then `passes` supervised passes."""
    demos = hindsight_demos(env, trajs, tok, rcfg, env_overrides, demos)
    policy.train()
    return imitate(demos, passes, policy, opt, ucfg, tok.pad_token_id, response_mask, gen, amp)
