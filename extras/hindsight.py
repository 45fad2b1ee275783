"""Hindsight imitation (GCSL), beyond the paper: `train.py --hindsight-imitation K`, off by default.

    python train.py --env sokoban --hindsight-imitation 3 --no-think --context-turns 1 --max-turns 10 \
        --max-actions-per-turn 1 --prompts 32 --rollouts 4          # the recipe: docs/results.md, "Hindsight"

Neither the paper nor RAGEN has it. From the tiny prior, StarPO-S alone does not learn Sokoban on a CPU (the
paper found RL weak on Sokoban: 20.3% against SFT's 74.6%): most rollouts fail, and a group whose rollouts
all fail has no reward spread, so no GRPO signal. GCSL (Ghosh et al. 2019) turns a failed rollout into a
success: a rollout that moved the box reached *some* goal, the cell where it left the box. Replayed with the
target there (its loop-free turns only, each reply re-rendered from its parsed actions as RAGEN's ctx_manager
does, with --think a thought true of the relabelled room) it is a demonstration, which the policy imitates
for K supervised passes after each RL update, on its own AdamW (`starpo.update` with advantage 1 and ratio
1: the gradient of the mean NLL). `--imitation-demos best`: each room's shortest solved rollout instead
(expert iteration), what lifts RL from the SFT policy (docs/results.md).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from engine import distributed as dist
from engine.logprobs import pad_segments, shared_prefix_len
from envs import ENVS, SokobanEnv
from rollout import RolloutConfig, Segment, expert_thought, rollout, trained_mask
from starpo import Batch, UpdateConfig, update


def supported(env: str) -> bool:
    """Relabelling moves a room's targets: Sokoban and its variants."""
    return isinstance(ENVS[env], type) and issubclass(ENVS[env], SokobanEnv)


def goal_env(env: str, overrides: dict, goal: tuple | None = None):
    """A room of Sokoban variant `env` with its targets moved to `goal` (box cells, as `reached_goal` gives
    them; None: its own), which also says where an episode left its boxes and narrates any moves."""

    class GoalSokoban(ENVS[env]):
        def _start(self, seed, noise):
            super()._start(seed, noise)
            self.start_boxes = self._boxes
            if goal is not None:  # the same room; it succeeds when the boxes stand on `goal`
                self._targets = tuple(sorted(goal))

        def reached_goal(self) -> tuple | None:
            """Where the boxes are now, as a goal: None when none moved (nothing was demonstrated) or they
            stand on the room's own targets."""
            now = tuple(sorted(self._boxes))
            return None if set(now) in (set(self.start_boxes), set(self._targets)) else now

        def note(self, moves: list[str]) -> str:
            """The expert's words for any moves from here: where things are, then the first push those moves
            make and the cell it is pushed from (unknown words and bumps push nothing)."""
            return self._note([i for i in map(self._parse, moves) if i is not None])

    return GoalSokoban(**overrides)


def loop_free_turns(env, traj) -> list[int]:
    """The turns of `traj` on its shortest way through the states it visited: a turn that leads back to a
    state the episode was in (a bump into a wall, a step back, a loop) is cut with the turns in between. The
    actions are stepped again on `env`, which ends where the episode ended."""
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


def demo_thoughts(sim, moves: list[list[str]]) -> list[str]:
    """With --think, each demo turn's thought in the expert's words, true of the replayed room `sim` (just
    reset): where things are with the target moved, the first push the demo's moves make from there, the
    turn's moves. The sampled thought read the original target: kept, it would teach a misreading. -> one
    thought per turn the replay plays (it ends where the relabelled target is reached)."""
    thoughts = []
    for j, turn in enumerate(moves):
        if sim.done:
            break
        thoughts.append(expert_thought(sim.note([a for m in moves[j:] for a in m]), turn))
        for a in turn:
            if not sim.done:
                sim.step(a)
    return thoughts


def replay_agent(plans: dict):
    """A scripted agent that re-sends each episode's planned (moves, thought) turns, then empty answers."""
    turns = {key: iter(plan) for key, plan in plans.items()}
    return lambda env, actions_left, cfg: next(turns[id(env)], ([], ""))


def hindsight_demos(env: str, trajs: list, tok, rcfg: RolloutConfig, env_overrides: dict,
                    demos: str = "hindsight") -> list:
    """GCSL's data: every rollout that moved the box, replayed in its own room with the target where it left
    the box (a rollout that solved the room keeps its target), its loop-free turns only. `demos="best"`: only
    each room's solved rollout of the fewest actions, unrelabelled (expert iteration: the best of N samples
    beats one sample). Every demo kept succeeds; no model runs. -> the demos' trajectories."""
    sim = goal_env(env, env_overrides)
    if demos == "best":
        best = {}
        for t in trajs:
            if t.success and (t.group_id not in best or t.num_actions < best[t.group_id].num_actions):
                best[t.group_id] = t
        trajs = list(best.values())
    rooms, seeds, plans = [], [], {}
    for t in trajs:
        turns = loop_free_turns(sim, t)  # leaves `sim` where the episode ended
        goal = None if t.success else sim.reached_goal()
        if not turns or (goal is None and not t.success):  # the box never moved, or ended where it began
            continue
        room = goal_env(env, env_overrides, goal)
        moves = [t.turns[k].actions for k in turns]
        if rcfg.think:
            replayed = goal_env(env, env_overrides, goal)
            replayed.reset(t.seed)
            thoughts = demo_thoughts(replayed, moves)
        else:
            thoughts = [""] * len(moves)
        rooms.append(room)
        seeds.append(t.seed)
        plans[id(room)] = list(zip(moves, thoughts))
    if not rooms:
        return []
    replays = rollout(rooms, seeds, list(range(len(seeds))), rcfg, tokenizer=tok, agent=replay_agent(plans))
    return [d for d in replays if d.success]


def imitate(demos: list, passes: int, policy, opt, ucfg: UpdateConfig, pad_id: int, response_mask: bool,
            gen: torch.Generator, amp) -> dict:
    """`passes` of supervised learning on the demos' replies: each mini-batch is one `update` with advantage 1
    on every trained token and the ratio exactly 1 (no old log-probs), whose gradient is that of the mean
    negative log-likelihood: no clip, no entropy bonus, no KL. -> metrics."""
    rows = [Segment(s.input_ids, trained_mask(s, response_mask)) for d in demos for s in d.segments]
    m = {"imitation/demos": float(len(demos)), "imitation/rows": float(len(rows)),
         "imitation/optimizer_steps": 0.0}
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


def imitation_step(cfg, trajs: list, policy, opt, ucfg: UpdateConfig, tok, rcfg: RolloutConfig,
                   env_overrides: dict, gen: torch.Generator, amp) -> dict:
    """One iteration's imitation (train.py's step 4b): the demos of its rollouts (`hindsight_demos`), then
    --hindsight-imitation supervised passes over them. -> metrics, time/imitation included."""
    t0 = time.time()
    demos = hindsight_demos(cfg.env, trajs, tok, rcfg, env_overrides, cfg.imitation_demos)
    policy.train()
    m = imitate(demos, cfg.hindsight_imitation, policy, opt, ucfg, tok.pad_token_id, cfg.response_mask, gen,
                amp)
    return {**m, "time/imitation": time.time() - t0}


def plug(cfg, points: dict, run: dict) -> None:
    """train.py's --hindsight-imitation K: its own AdamW (a supervised step wants ~5x the RL step;
    checkpointed with the run's optimizers), and a hook after each update that imitates this iteration's
    demos."""
    trainable = [p for p in run["policy"].parameters() if p.requires_grad]
    run["optimizers"]["imit_opt"] = torch.optim.AdamW(trainable, lr=cfg.imitation_lr, weight_decay=0.0,
                                                      betas=(0.9, 0.95))

    def imitate_after_update(it: int, trajs: list, m: dict) -> None:
        gen = torch.Generator().manual_seed(run["seed"](it, 77))
        m.update(imitation_step(cfg, trajs, run["train_policy"], run["optimizers"]["imit_opt"], run["ucfg"],
                                run["tok"], run["rcfg"], run["env_kw"], gen, run["amp"]))
    points["after_update"].append(imitate_after_update)
