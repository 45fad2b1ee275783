"""StarPO / StarPO-S training (paper sections 2-4): multi-turn rollouts -> variance filter -> PPO/GRPO update.

    python train.py --env sokoban --algo grpo --filter 0.25            # StarPO-S with GRPO, tiny policy, CPU
    python train.py --preset starpo --env sokoban                      # the StarPO baseline (no filter, KL, 0.2/0.2)
    python train.py --env sokoban --algo ppo --model Qwen/Qwen2.5-0.5B-Instruct --steps 200   # the paper, 1 GPU
    python train.py --plot runs/a runs/b                               # Echo Trap signals of several runs, one PNG
    torchrun --standalone --nproc_per_node 8 train.py --env sokoban --algo ppo --model Qwen/Qwen2.5-0.5B-Instruct

One loop, top to bottom: sample P prompts (fresh training seeds, never eval seeds; x online_k) x N rollouts ->
keep the prompt groups with the largest in-group reward std (StarPO-S, section 4.2) -> the batch: values and
advantages (GRPO: group-normalised; PPO: GAE with the critic), old and reference log-probs where a pass needs
them -> `ppo_epochs` passes of mini-batch updates (-> hindsight imitation, deviation 10) -> one JSONL line + one
printed line -> eval and checkpoint.

The Echo Trap monitor (section 4.1) watches the paper's four signals: it warns when the in-group reward std
stays below 0.1x its early level for 10 iterations, when the grad norm jumps above 5x its running median, and
when entropy swings by more than half its running median; `--stop-on-collapse` ends the run there, cleanly.

The paper's runs, one flag each: `--preset starpo` / `starpo-s`, `--no-response-mask`, `--online-k`,
`--loss-agg` (docs/faithfulness.md).

Deviations from the paper / RAGEN (deliberate):
1. All randomness of iteration i (training seeds, sampling, mini-batch order) derives from (seed, i), so
   `--resume` reproduces an uninterrupted run without saving generator states.
2. `--model tiny` (and a tiny-sized folder) has its own defaults (steps, learning rates, eval prompts, micro-batches
   of 16), sized for a 2-core CPU, and on Sokoban without a preset its own rendering and batch: one move per turn,
   no thought, a one-turn window, 32 rooms x 4 rollouts, with hindsight imitation (deviation 10); a folder trained
   from it keeps its own rendering and the paper's batch. Every other model, and `--preset starpo(-s)`, gets the
   paper's.
3. Only needed passes run, on the kept groups only: no old log-probs when the kept rows are one optimizer step
   (ratio exactly 1); without a KL term the reference only on eval iterations, for `train/kl_to_init` (verl: all).
4. The default trains only the sampled tokens (`--response-mask`, RAGEN's later default); the paper's runs
   trained every token after the system prompt (`--no-response-mask`).
5. A batch whose groups all have zero reward std is logged (`train/skipped_zero_std`) and, for GRPO, skipped:
   its advantages would all be 0. PPO's are R - V: it updates.
6. The KL reference is the initial policy, kept in memory (as verl's ref model).
7. Under torchrun (distributed.py; RAGEN: verl + Ray) each rank rolls out P / W whole groups, then all is gathered:
   the filter, advantages and metrics run on the same data; rank r samples with seed + r * 2**40 (W changes them).
8. Only rank 0 logs, evaluates, plots and writes checkpoints; `--resume` on several nodes needs a shared folder.
9. `--hindsight` (off by default; neither the paper nor RAGEN has it): Hindsight Experience Replay (Andrychowicz
   et al. 2017) as GRPO groups, for Sokoban. Each room's rollouts are replayed with the target moved to where one of
   them left the box (loop-free turns only), and these groups join the batch unfiltered. The replies were sampled
   under the real room and are trained as if under the relabelled one, without importance weights.
10. `--hindsight-imitation K` (neither the paper nor RAGEN has it; on by default only for the tiny policy on
   Sokoban): GCSL (Ghosh et al. 2019) beside the RL update. Each rollout that moved the box is relabelled as a
   success with the target where it left the box (loop-free turns, replies re-rendered as RAGEN does; with --think
   the thought rewritten in the expert's words, true of the relabelled room and the demo's moves), and K passes
   of supervised learning on them follow the update, on their own AdamW (lr 2.5e-4 for the tiny policy on Sokoban,
   else 5e-4). `--imitation-demos best` learns instead from each room's shortest solved rollout, unrelabelled
   (expert iteration, Anthony et al. 2017). From the tiny prior, GRPO alone does not learn Sokoban on a CPU; with
   this term the main command does (docs/experiments.md section 0).
"""
from __future__ import annotations

import copy
import json
import math
import os
import shutil
import statistics
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch

import cli
import distributed as dist
from advantages import (broadcast_to_tokens, gae, grpo_advantages, kl_penalized_rewards,
                        place_reward_on_last_token, whiten)
from envs import ENVS, train_seeds
from eval import ROLLOUT_KEYS, evaluate, saved_rollout_settings, summarize
from filter import select_groups
from rollout import (RolloutConfig, Segment, default_reply_tokens, dump, expert_thought, rollout, scripted_reply,
                     trained_mask)
from starpo import (AGG_MODES, Batch, TokenLogprobs, UpdateConfig, make_optimizer, masked_mean, shared_prefix_len,
                    token_logprobs, update)

# The paper's rendering and batch (section 3.3, Appendix C.2): the defaults of every model and environment but one
PAPER_DEFAULTS = dict(think=True, context_turns=0, max_turns=5, max_actions_per_turn=5, prompts=8, rollouts=16,
                      hindsight_imitation=0)
PRESETS = {  # the paper's two recipes (section 4.2, Appendix C.2/D), rendering and batch included; flags typed
    # explicitly win. StarPO's KL is RAGEN's: k1 (`kl`), in the token rewards for PPO (apply_kl_penalty), a loss
    # term for GRPO (see derive)
    "starpo": dict(filter=1.0, kl_coef=0.001, kl_kind="k1", clip_low=0.2, clip_high=0.2, **PAPER_DEFAULTS),
    "starpo-s": dict(filter=0.25, kl_coef=0.0, clip_low=0.2, clip_high=0.28, **PAPER_DEFAULTS),
}
# Per-model defaults for fields left at None. Qwen: the paper's (Appendix C.2). tiny: what trains on a CPU.
MODEL_DEFAULTS = {
    "tiny": dict(lr=1e-4, critic_lr=1e-3, steps=30, eval_prompts=128, micro_batch=16),
    "hf": dict(lr=1e-6, critic_lr=1e-5, steps=200, eval_prompts=256, micro_batch=4),
}
# the embedded tiny prior on Sokoban without a preset, where the paper's recipe does not learn on a CPU
# (docs/experiments.md section 0):
# one move per turn, no thought, a one-turn window, 32 rooms x 4 rollouts, and GCSL's hindsight imitation at lr 2.5e-4.
TINY_SOKOBAN_DEFAULTS = dict(think=False, context_turns=1, max_turns=10, max_actions_per_turn=1, prompts=32,
                             rollouts=4, hindsight_imitation=3, imitation_lr=2.5e-4, eval_prompts=256)


@dataclass
class Config:
    env: str = cli.flag("sokoban", "environment", choices=ENVS)
    algo: str = cli.flag("grpo", "advantage estimator: grpo (group-normalised) or ppo (critic + GAE)",
                         choices=["grpo", "ppo"])
    preset: str | None = cli.flag(None, "the paper's recipes: starpo or starpo-s (explicit flags override)",
                                  choices=sorted(PRESETS))
    filter: float = cli.flag(0.25, "fraction of prompt groups kept by in-group reward std (1.0 = off)", gt=0, hi=1)
    filter_smallest: bool = cli.flag(False, "keep the LOWEST-variance groups instead (the paper's ablation)")
    hindsight: bool = cli.flag(False, "Sokoban: add one hindsight group per room, its N rollouts replayed with the "
                                      "target moved to where one of them left the box (HER), all kept")
    hindsight_imitation: int | None = cli.flag(None, "Sokoban: after each update, this many passes of supervised "
                                                     "imitation over the iteration's rollouts, each relabelled as a "
                                                     "success with the target where it left the box (GCSL); 0 = off "
                                                     "(default: 3 for the embedded tiny policy, else 0)", lo=0)
    imitation_demos: str = cli.flag("hindsight", "what the imitation learns from: hindsight (every moving rollout, "
                                    "relabelled) or best (each room's shortest solved rollout)",
                                    choices=["hindsight", "best"])
    imitation_lr: float | None = cli.flag(None, "learning rate of the hindsight imitation (its own AdamW; default: "
                                                "2.5e-4 for the embedded tiny policy on Sokoban, else 5e-4)", gt=0)
    kl_coef: float = cli.flag(0.0, "KL-to-initial-policy coefficient (paper StarPO: 0.001; 0 = KL removal, "
                                   "StarPO-S: KL is still measured)", lo=0)
    kl_kind: str = cli.flag("k3", "KL estimator: k1 (RAGEN's `kl`, the paper's runs) or k3 (low-variance)",
                            choices=["k1", "k3"])
    kl_in_reward: bool | None = cli.flag(None, "PPO: subtract kl_coef x KL from the token rewards (RAGEN's "
                                               "apply_kl_penalty) instead of a loss term (default: on with --preset "
                                               "starpo --algo ppo, as the paper ran)")
    clip_low: float = cli.flag(0.2, "PPO clip eps_low", lo=0, lt=1)
    clip_high: float = cli.flag(0.28, "PPO clip eps_high (Clip-Higher; StarPO: 0.2)", lo=0)
    entropy_coef: float = cli.flag(0.001, "entropy bonus coefficient", lo=0)
    prompts: int | None = cli.flag(None, "P: prompts (initial states) per iteration (default: 8; tiny on Sokoban 32)",
                                   lo=1)
    rollouts: int | None = cli.flag(None, "N: rollouts per prompt, a group (default: 16; tiny on Sokoban 4)", lo=2)
    max_turns: int | None = cli.flag(None, "turns per episode (default: 5; tiny on Sokoban 10)", lo=1)
    max_actions_per_turn: int | None = cli.flag(None, "actions per turn (default: 5; tiny on Sokoban 1)", lo=1)
    max_actions: int = cli.flag(10, "actions per episode", lo=1)
    max_new_tokens: int | None = cli.flag(None, "token budget per reply (default: tiny 100; hub models RAGEN's "
                                                "400, 500 on bandit)", lo=1)
    format_penalty: float = cli.flag(-0.1, "reward of a turn without a valid answer")
    gamma: float = cli.flag(1.0, "GAE discount (PPO)", lo=0, hi=1)
    lam: float = cli.flag(1.0, "GAE lambda (PPO)", lo=0, hi=1)
    grpo_std_norm: bool = cli.flag(True, "GRPO divides by the group std (off: Dr.GRPO's mean-only)")
    mini_batch: int = cli.flag(32, "training sequences per optimizer step", lo=1)
    micro_batch: int | None = cli.flag(None, "training sequences per forward/backward (gradient accumulation; "
                                             "default: 4, tiny 16)", lo=1)
    ppo_epochs: int = cli.flag(1, "passes over each rollout batch (the paper's runs: 1)", lo=1)
    online_k: int = cli.flag(1, "RAGEN's Online-k (paper Figure 7): roll out k x P prompts at once and use each "
                                "trajectory once, over k times the optimizer steps (paper: 1)", lo=1)
    group_noise: str = cli.flag("shared", "the N rollouts of a prompt meet the same payoffs/slips (shared: RAGEN's "
                                          "seeding) or draw their own (independent)", choices=["shared", "independent"])
    response_mask: bool = cli.flag(True, "train only the tokens the policy sampled (--no-response-mask: every "
                                         "token after the system prompt, as the paper's runs did)")
    loss_agg: str = cli.flag("token-mean", "how token losses become one: token mean over the mini-batch, or per "
                                           "sequence first (seq-mean-token-mean = the paper's 1/|tau| form)",
                             choices=list(AGG_MODES))
    temperature: float = cli.flag(1.0, "rollout sampling temperature", gt=0)
    think: bool | None = cli.flag(None, "<think>...</think> before <answer> (--no-think: answer only; default: on, "
                                        "tiny on Sokoban off)")
    context_turns: int | None = cli.flag(None, "history window: 0 = whole conversation (paper), K = last K turns "
                                               "(default: 0; tiny on Sokoban 1)", lo=0)
    steps: int | None = cli.flag(None, "training iterations (default: tiny 30, hub models 200)", lo=1)
    eval_every: int = cli.flag(10, "evaluate every this many iterations (0 = only at the end)", lo=0)
    eval_prompts: int | None = cli.flag(None, "eval prompts, <= 256 (default: tiny 128, on Sokoban 256; hub models "
                                              "256)", lo=1, hi=256)
    eval_temperature: float = cli.flag(0.5, "eval sampling temperature (paper: 0.5)", lo=0)
    save_every: int = cli.flag(10, "checkpoint every this many iterations (0 = none, only final/)", lo=0)
    dump_trajectories: int = cli.flag(3, "trajectories written as text at each eval", lo=0)
    stop_on_collapse: bool = cli.flag(False, "end the run cleanly when the Echo Trap monitor fires")
    seed: int = cli.flag(0, "seed of everything (training seeds, sampling, mini-batch order)", lo=0, hi=cli.SEED_MAX)
    out: str | None = cli.flag(None, "run folder (default: runs/ENV-ALGO-sSEED); never overwritten unless --overwrite")
    resume: str | None = cli.flag(None, "continue the run in this folder from its last checkpoint (only --steps, "
                                        "--device and --threads may change)")
    overwrite: bool = cli.flag(False, "replace the run already in --out (its metrics, checkpoints, dumps, final/)")
    model: str = cli.flag("tiny", "tiny (embedded, offline), a hub id such as Qwen/Qwen2.5-0.5B-Instruct, or a folder")
    lr: float | None = cli.flag(None, "policy learning rate (default: tiny 1e-4, hub models 1e-6)", gt=0)
    critic_lr: float | None = cli.flag(None, "critic learning rate, PPO (default: tiny 1e-3, hub models 1e-5)", gt=0)
    device: str = cli.flag("auto", "auto (CUDA if present), cpu, cuda or cuda:N")
    threads: int = cli.flag(1, "CPU threads (1 measured fastest for small models on 2-core machines)", lo=1)
    fused: bool = cli.flag(True, "chunked log-prob/entropy path that never builds [B, T, V] logits")
    webshop_data: str | None = cli.flag(None, "folder with the original WebShop files (default: shipped catalogue)")
    plot: list[str] | None = cli.flag(None, "draw the Echo Trap signals of these run folders into one PNG and exit")
    plot_out: str | None = cli.flag(None, "where --plot writes its PNG (default: FIRST_RUN/echo_trap.png)")
    # derived right after parsing
    groups: int = field(default=0, metadata={"derived": True})       # prompt groups rolled out: P x online_k
    groups_kept: int = field(default=0, metadata={"derived": True})


def derive(cfg: Config) -> Config:
    """Per-model defaults, sizes that follow from the flags, and one-line errors for bad values."""
    from policy import model_kind
    kind = model_kind(cfg.model)  # tiny-sized folders get the tiny defaults too
    # the embedded prior only: a trained folder (an SFT policy) keeps the paper's batch; a preset asks for the paper
    tiny_sokoban = TINY_SOKOBAN_DEFAULTS if cfg.model == "tiny" and hasattr(ENVS[cfg.env], "reached_goal") and \
        cfg.preset is None else {}
    cli.fill_defaults(cfg, {**PAPER_DEFAULTS, "imitation_lr": 5e-4, **MODEL_DEFAULTS[kind], **tiny_sokoban,
                            "max_new_tokens": default_reply_tokens(kind, cfg.env),
                            "kl_in_reward": cfg.preset == "starpo" and cfg.algo == "ppo"})
    cli.check(cli.bounds(cfg) + [(not (cfg.kl_in_reward and cfg.algo == "grpo"), "--kl-in-reward: PPO only (GRPO "
                                  "has no token rewards; its KL is a loss term, RAGEN's kl_loss_type)")])
    cfg.groups = cfg.prompts * cfg.online_k
    cfg.groups_kept = max(1, int(cfg.filter * cfg.groups))
    cfg.out = cfg.out if cfg.out is not None else f"runs/{cfg.env}-{cfg.algo}-s{cfg.seed}"
    return cfg


def inherit_rendering(cfg: Config, explicit: set[str]) -> Config:
    """A --model folder saved by train.py or sft_baseline.py is trained on prompts rendered as it was trained
    (history window, think mode, budgets, from its train_config.json), unless a flag says otherwise."""
    inherited = {k: v for k, v in saved_rollout_settings(cfg.model, "--model").items() if k not in explicit}
    if inherited and os.environ.get("RANK", "0") == "0":  # before the process group exists: torchrun's variable
        print(f"rollout settings of {cfg.model}: {json.dumps(inherited)}")
    return replace(cfg, **inherited)


def load_model_and_env(cfg, device):
    """-> (policy, tokenizer, its path, env overrides), checked before a run writes anything."""
    from policy import load_policy
    with dist.main_first():  # rank 0 builds (tiny) or downloads the model into the cache, then the others load
        policy, tok, path = load_policy(cfg.model, device)
    positions = getattr(policy.config, "max_position_embeddings", None)
    if positions is not None and cfg.max_new_tokens >= positions:
        raise ValueError(f"--max-new-tokens {cfg.max_new_tokens}: the model reads at most {positions} positions")
    env_overrides = {"data_dir": cfg.webshop_data} if cfg.webshop_data else {}
    ENVS[cfg.env](**env_overrides)
    return policy, tok, path, env_overrides


def rollout_config(cfg: Config, temperature: float) -> RolloutConfig:
    return RolloutConfig(temperature=temperature, **{k: getattr(cfg, k) for k in ROLLOUT_KEYS})


def group_samples(group_noise: str, groups: int, rollouts: int) -> list[int]:
    """The `sample` of each rollout, group after group (envs.py deviation 2): `shared` gives all N rollouts of a
    prompt the same payoffs and slips, as RAGEN seeds them; `independent` numbers them 0..N-1."""
    return [k if group_noise == "independent" else 0 for _ in range(groups) for k in range(rollouts)]


def iteration_rollouts(cfg: Config, it: int, policy, tok, rcfg: RolloutConfig, env_overrides: dict, device) -> list:
    """Iteration `it`'s rollouts, in group order, on every rank: every rollout of a prompt shares its initial state
    (a group) and, with --group-noise shared, its luck. Each rank rolls out its whole groups (all in one process),
    then every rank holds all of them (the filter ranks ALL groups). Rooms come from (seed, it); sampling from
    (seed, it, rank), rank 0's stream being the single-process one (deviation 7)."""
    gen = torch.Generator(device=device).manual_seed(cfg.seed * 1_000_003 + it + (dist.rank() << 40))
    seeds = train_seeds(np.random.default_rng([cfg.seed, it]), cfg.groups)
    mine = dist.my_range(cfg.groups)
    policy.eval()
    trajs = rollout(cfg.env, [seeds[g] for g in mine for _ in range(cfg.rollouts)],
                    [g for g in mine for _ in range(cfg.rollouts)], rcfg, tokenizer=tok, model=policy,
                    generator=gen, env_overrides=env_overrides,
                    samples=group_samples(cfg.group_noise, len(mine), cfg.rollouts))
    return dist.all_gather_objects(trajs)


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


def hindsight_rollouts(cfg: Config, it: int, trajs: list, tok, rcfg: RolloutConfig, env_overrides: dict) -> list:
    """Hindsight groups (Andrychowicz et al. 2017, "Hindsight Experience Replay", moved to GRPO groups): for each
    room, one goal drawn from (seed, it) among the cells where its rollouts left the box, and all N rollouts of the
    room replayed with the target there: their sampled replies, the loop-free turns only (a replay of bumps and
    loops teaches nothing about reaching a goal), observations that show the new target, the env's rewards for it.
    The rollout that reached the goal succeeds, so a room whose N rollouts all failed still yields a group with a
    spread. Group ids follow the real ones (G + g). Replays are stepped, not sampled: no model runs."""
    rng = np.random.default_rng([cfg.seed, it, 1])
    sim = ENVS[cfg.env](**env_overrides)
    seeds, gids, goals, replies = [], [], [], []
    for g in range(cfg.groups):
        group = trajs[g * cfg.rollouts:(g + 1) * cfg.rollouts]
        reached = sorted({t.reached_goal for t in group if t.reached_goal is not None})
        if not reached:  # no rollout moved the box off its start (or all solved the room itself)
            continue
        goal = reached[int(rng.integers(len(reached)))]
        for t in group:
            turns = loop_free_turns(sim, t) or [0]  # back where it began: its first turn keeps it in the group
            seeds.append(t.seed)
            gids.append(cfg.groups + g)
            goals.append(goal)
            replies.append([t.turns[k].tokens for k in turns])
    if not seeds:
        return []
    return rollout(cfg.env, seeds, gids, rcfg, tokenizer=tok, replies=replies, goals=goals,
                   env_overrides=env_overrides)


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


def hindsight_demos(cfg: Config, trajs: list, tok, rcfg: RolloutConfig, env_overrides: dict) -> list:
    """GCSL's data (Ghosh et al. 2019, "Learning to Reach Goals via Iterated Supervised Learning"): every rollout that
    moved the box is a demonstration of reaching where it left the box. It is replayed in its own room with the target
    moved there (a rollout that solved the room keeps its target): its loop-free turns only, each reply re-rendered
    from its parsed actions as RAGEN's ctx_manager does (`scripted_reply`, the answer format), with --think after a
    thought true of the replayed room (`demo_thoughts`). Every demo succeeds by construction; no model runs.
    `--imitation-demos best`: only each room's solved rollout of the fewest actions, in its own room (expert iteration,
    Anthony et al. 2017: the best of N samples is a better policy than one sample)."""
    sim = ENVS[cfg.env](**env_overrides)
    if cfg.imitation_demos == "best":
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
    demos = rollout(cfg.env, seeds, list(range(len(seeds))), rcfg, tokenizer=tok, replies=replies, goals=goals,
                    env_overrides=env_overrides)
    return [d for d in demos if d.success]


def imitate(cfg: Config, it: int, demos: list, policy, opt, ucfg: UpdateConfig, pad_id: int, device, amp) -> dict:
    """`hindsight_imitation` passes of supervised learning on the demos' replies: each mini-batch is one `update`
    with advantage 1 on every trained token and the ratio exactly 1 (no old log-probs), whose gradient is that of
    the mean negative log-likelihood, -grad log p: no clip, no entropy bonus, no KL. -> metrics."""
    from policy import pad_segments
    rows = [Segment(s.input_ids, trained_mask(s, cfg.response_mask)) for d in demos for s in d.segments]
    m = {"imitation/demos": float(len(demos)), "imitation/rows": float(len(rows)), "imitation/optimizer_steps": 0.0}
    if not rows:
        return m
    ids, attn, mask = pad_segments(rows, pad_id)  # [B, T] each
    data = Batch(input_ids=ids, attention_mask=attn, loss_mask=mask, advantages=mask.float(),
                 prefix_len=shared_prefix_len([r.input_ids for r in rows]))
    icfg = replace(ucfg, entropy_coef=0.0, kl_coef=0.0)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + it * 101 + 77)
    entropies = []
    for _ in range(cfg.hindsight_imitation):
        perm = torch.randperm(len(rows), generator=gen)
        for start in range(0, len(rows), ucfg.mini_batch):
            um = update(policy, opt, data.select(perm[start:start + ucfg.mini_batch]), icfg, generator=gen,
                        autocast_dtype=amp, shard=(dist.rank(), dist.world_size()))
            m["imitation/optimizer_steps"] += um["train/optimizer_steps"]
            entropies.append(um["train/entropy"])
    m["imitation/entropy"] = statistics.fmean(entropies)  # of the demos' tokens, before each step
    return m


def kept_trajectories(cfg: Config, it: int, trajs: list, tok, rcfg: RolloutConfig, env_overrides: dict):
    """The StarPO-S filter (section 4.2): the groups with the largest in-group reward std, whole groups in or out;
    with --hindsight, every hindsight group on top.
    -> (kept trajectories, whether no group has a reward spread, metrics)."""
    rewards = torch.tensor([t.reward for t in trajs]).view(cfg.groups, cfg.rollouts)  # [G, N]
    keep, fstats = select_groups(rewards, keep=cfg.filter, largest=not cfg.filter_smallest)
    m = {f"rollout/{k}": fstats[k] for k in ("in_group_std", "in_group_std_max", "chosen_in_group_std",
                                             "filter_kept", "zero_std_groups")}
    kept = [t for t in trajs if keep[t.group_id]]
    no_spread = fstats["all_zero_std"]
    if cfg.hindsight:
        t0 = time.time()
        hind = hindsight_rollouts(cfg, it, trajs, tok, rcfg, env_overrides)
        m["time/hindsight"] = time.time() - t0
        m["rollout/hindsight_groups"] = len(hind) // cfg.rollouts
        m["rollout/hindsight_success"] = statistics.fmean(t.success for t in hind) if hind else 0.0
        if hind:  # every hindsight group is kept: each has a success by construction, so the filter's reason
            # to drop a group (no spread, no signal) does not apply, and its successes are the data it adds
            kept += hind
            _, hstats = select_groups(torch.tensor([t.reward for t in hind]).view(-1, cfg.rollouts), keep=1.0)
            m["rollout/hindsight_in_group_std"] = hstats["in_group_std"]
            no_spread = no_spread and hstats["all_zero_std"]
    return kept, no_spread, m


def weights_finite(policy) -> bool:
    """Whether every weight of the policy is finite (one host sync, after a phase that stepped an optimizer)."""
    return bool(torch.stack([torch.isfinite(p).all() for p in policy.parameters()]).all())


def evaluates(cfg: Config, it: int) -> bool:
    """Whether iteration `it` (0-based) ends with an eval: every eval_every iterations and the last one."""
    return bool(cfg.eval_every and (it + 1) % cfg.eval_every == 0) or it + 1 == cfg.steps


# ------------------------------------------------------------------------------------------- the batch

@torch.no_grad()
def prepare_batch(kept, cfg: Config, policy, ref, critic, pad_id: int, device, amp, on_eval: bool):
    """The update's inputs from the kept trajectories (section 2.2, Appendix A): rows, old and reference
    log-probs, values, advantages. -> (Batch, metrics). Under torchrun each rank runs its share of the rows and
    every rank ends with the whole batch (GAE and whitening see all of it)."""
    scores = torch.tensor([t.reward for t in kept])
    if cfg.algo == "grpo":
        adv_traj = grpo_advantages(scores, [t.group_id for t in kept], norm_by_std=cfg.grpo_std_norm)
    else:
        adv_traj = torch.zeros(len(kept))  # PPO's advantages come from GAE below
    from policy import pad_segments
    rows = [(s, t.reward, a) for t, a in zip(kept, adv_traj.tolist()) for s in t.segments]  # one row per segment
    ids, attn, mask = (x.to(device) for x in pad_segments(
        [Segment(s.input_ids, trained_mask(s, cfg.response_mask)) for s, _, _ in rows], pad_id))  # [B, T] each
    row_scores = torch.tensor([r for _, r, _ in rows])                   # [B] each row's trajectory reward
    row_adv = torch.tensor([a for _, _, a in rows], dtype=torch.float)  # [B] its GRPO advantage (PPO: zeros)
    pre = shared_prefix_len([s.input_ids for s, _, _ in rows])  # the prompt header, run once
    mine = dist.my_range(len(ids))

    def run(fn):  # fn(ids, attn) -> [b, T] on this rank's rows (B may be 0), micro-batch by micro-batch -> [B, T]
        my_ids, my_attn, micro = ids[mine.start:mine.stop], attn[mine.start:mine.stop], cfg.micro_batch
        parts = [fn(my_ids[j:j + micro], my_attn[j:j + micro]) for j in range(0, len(my_ids), micro)]
        return dist.gather_rows(torch.cat(parts) if parts else torch.zeros(my_ids.shape, device=device), len(ids))

    def logp(model):
        return lambda i, a: token_logprobs(model, i, a, cfg.temperature, cfg.fused, prefix_len=pre)[0].float()
    # No forward pass whose answer is known: one optimizer step on these fresh rollouts has ratio 1, so update()
    # takes the old log-probs from its own forward. Without a KL term the reference only feeds the
    # train/kl_to_init monitor, measured on the iterations that evaluate.
    one_step = len(ids) <= cfg.mini_batch and cfg.ppo_epochs == 1 and not cfg.kl_in_reward
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        old_logp = None if one_step else run(logp(policy))                                  # [B, T]
        ref_logp = run(logp(ref)) if cfg.kl_coef > 0 or on_eval else None                   # [B, T]
        values = run(lambda i, a: critic(i, a).float()) if critic is not None else None     # [B, T]
    metrics = {}
    if cfg.algo == "grpo":
        adv, returns = broadcast_to_tokens(row_adv.to(device), mask), None
    else:  # the trajectory reward on each row's last trained token; GAE over the trained tokens
        token_rewards = place_reward_on_last_token(row_scores.to(device), mask)
        if cfg.kl_in_reward:  # StarPO with PPO as the paper ran it (RAGEN's apply_kl_penalty)
            token_rewards = kl_penalized_rewards(token_rewards, old_logp, ref_logp, mask, cfg.kl_coef)
            metrics["train/kl_in_reward"] = masked_mean(old_logp - ref_logp, mask).item()
        adv, returns = gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
        adv = whiten(adv, mask)  # over the global batch: every rank holds all of it
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=mask, advantages=adv, old_logp=old_logp,
                 ref_logp=ref_logp, returns=returns, old_values=values, prefix_len=pre), metrics


# ------------------------------------------------------------------------------------------- Echo Trap

@dataclass
class EchoMonitor:
    """The paper's early-warning signals (section 4.1): reward std collapse, grad-norm spikes, entropy swings."""
    std_history: list = field(default_factory=list)
    grad_history: list = field(default_factory=list)
    ent_history: list = field(default_factory=list)
    low_std_run: int = 0


def echo_check(mon: EchoMonitor, m: dict, baseline_iters: int = 5, std_ratio: float = 0.1, patience: int = 10,
               grad_factor: float = 5.0, ent_swing: float = 0.5, window: int = 20) -> dict[str, str]:
    """Update the monitor with one iteration's metrics; -> {signal: warning} for the signals that fired
    (std_collapse, grad_spike, entropy_swing; empty when all is well)."""
    warnings = {}
    std = m.get("rollout/in_group_std")
    if std is not None:
        mon.std_history.append(std)
        if len(mon.std_history) > baseline_iters:
            base = statistics.fmean(mon.std_history[:baseline_iters])
            mon.low_std_run = mon.low_std_run + 1 if std < std_ratio * base else 0
            if mon.low_std_run >= patience:
                warnings["std_collapse"] = (f"reward std {std:.4f} < {std_ratio}x its early level {base:.4f} "
                                            f"for {mon.low_std_run} iterations")
    g = m.get("train/grad_norm")
    if g is not None and math.isfinite(g):
        past = mon.grad_history[-window:]
        if len(past) >= 5 and g > grad_factor * statistics.median(past):
            warnings["grad_spike"] = (f"grad norm {g:.3g} > {grad_factor}x its running median "
                                      f"{statistics.median(past):.3g}")
        mon.grad_history.append(g)
    e = m.get("train/entropy")
    if e is not None and math.isfinite(e):
        past = mon.ent_history[-window:]
        med = statistics.median(past) if len(past) >= 5 else None
        if med is not None and abs(e - med) > ent_swing * med:
            warnings["entropy_swing"] = (f"entropy {e:.3g} swung by more than {ent_swing:.0%} from its running "
                                         f"median {med:.3g}")
        mon.ent_history.append(e)
    return warnings


# ------------------------------------------------------------------------------------------- checkpoints

RESUMABLE = {"resume", "steps", "device", "threads"}  # the flags a resumed run may change


def resume_config(cfg: Config, explicit: set[str]) -> Config:
    """The run's own config from RUN/config.json, with --steps, --device and --threads as typed (other flags
    would be ignored, so they are an error)."""
    run = Path(cfg.resume)
    if not (run / "config.json").is_file():
        raise ValueError(f"--resume {cfg.resume}: no config.json there (is it a run folder?)")
    saved = cli.read_json(run / "config.json", f"--resume {cfg.resume}")
    unknown = sorted(set(saved) - {f.name for f in fields(Config)})
    if unknown:
        raise ValueError(f"--resume {cfg.resume}: {run / 'config.json'} has keys this train.py does not know: "
                         f"{', '.join(unknown)}")
    ignored = sorted(explicit - RESUMABLE)
    if ignored:
        raise ValueError(f"--resume keeps the run's own config; it cannot change "
                         f"{', '.join('--' + k.replace('_', '-') for k in ignored)} (allowed with --resume: "
                         f"--steps, --device, --threads)")
    saved.setdefault("imitation_demos", "hindsight")
    saved.setdefault("hindsight_imitation", 0)  # a run saved before the flag existed ran without it
    return Config(**{**saved, **{k: getattr(cfg, k) for k in explicit}, "out": cfg.resume})


def read_checkpoint(out: Path, device):
    """-> (step, state dict, checkpoint folder) of the run's latest checkpoint, or None if it has none yet.
    A checkpoint that cannot be read is a ValueError naming its file."""
    if not (out / "latest").is_file():
        return None
    ck = out / (out / "latest").read_text().strip()
    try:
        state = torch.load(ck / "state.pt", map_location=device, weights_only=False)
        step = int(state["step"])
    except Exception as e:  # a damaged file is the user's input here: name it
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ValueError(f"--resume {out}: cannot read {ck / 'state.pt'} ({type(e).__name__}: {first})") from None
    return step, state, ck


def read_metrics(path: Path, upto: int) -> list[str]:
    """The metrics lines of iterations 1..upto (a resumed run continues after them)."""
    if not path.is_file():
        raise ValueError(f"--resume {path.parent}: {path} is missing; its checkpoint is at iteration {upto}, but "
                         f"resuming would leave no record of the iterations before it")
    kept = []
    for n, text in enumerate(path.read_text().splitlines(), 1):
        if text.strip():
            try:
                step = json.loads(text)["step"]
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"--resume {path.parent}: {path} line {n} is not a metrics line") from None
            if step <= upto:
                kept.append(text)
    return kept


def save_checkpoint(out: Path, step: int, policy, tok, critic, opt, critic_opt, imit_opt, monitor, cfg: Config):
    """Write ckpt-STEP/ completely, then point `latest` at it atomically (temp file + rename)."""
    final = out / f"ckpt-{step:06d}"
    tmp = out / f".tmp-ckpt-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)
    policy.save_pretrained(tmp / "policy")
    tok.save_pretrained(tmp / "policy")
    state = {"step": step, "opt": opt.state_dict(), "monitor": asdict(monitor)}
    if imit_opt is not None:
        state["imit_opt"] = imit_opt.state_dict()
    if critic is not None:
        critic.save_pretrained(str(tmp / "critic"))
        state["critic_opt"] = critic_opt.state_dict()
    torch.save(state, tmp / "state.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = out / ".latest.tmp"
    pointer.write_text(final.name)
    os.replace(pointer, out / "latest")
    for old in out.glob("ckpt-*"):  # keep the newest two
        if old.name not in (final.name, f"ckpt-{step - cfg.save_every:06d}"):
            shutil.rmtree(old, ignore_errors=True)


def save_final(out: Path, policy, tok, cfg: Config):
    """A plain save_pretrained folder (+ train_config.json so eval.py renders prompts the same way)."""
    final = out / "final"
    policy.save_pretrained(final)
    tok.save_pretrained(final)
    (final / "train_config.json").write_text(json.dumps(asdict(cfg), indent=2))


# ------------------------------------------------------------------------------------------- main

def main(argv=None):
    # ---- config: the flags (or, with --resume, the run's own config), all checked before anything is written
    try:
        cfg, explicit = cli.parse(Config, argv, description=__doc__.split("\n")[0], presets=PRESETS)
        if cfg.plot:
            from plot import plot_runs
            print(plot_runs(cfg.plot, cfg.plot_out))
            return None
        cfg = derive(resume_config(cfg, explicit) if cfg.resume else inherit_rendering(cfg, explicit))
        out = Path(cfg.out) if cfg.resume else cli.run_folder(cfg.out, "--out", cfg.overwrite)
        allowed = ", ".join(sorted(n for n, e in ENVS.items() if hasattr(e, "reached_goal")))
        if cfg.hindsight and not hasattr(ENVS[cfg.env], "reached_goal"):
            raise ValueError(f"--hindsight: only for {allowed} (this run: --env {cfg.env})")
        if cfg.hindsight_imitation and not hasattr(ENVS[cfg.env], "reached_goal"):
            raise ValueError(f"--hindsight-imitation {cfg.hindsight_imitation}: only for {allowed} (this run: --env "
                             f"{cfg.env}; 0 turns it off)")
        if cfg.imitation_demos != "hindsight" and not cfg.hindsight_imitation:
            raise ValueError(f"--imitation-demos {cfg.imitation_demos}: the demos of --hindsight-imitation K, which is "
                             f"0 in this run (give K >= 1)")
        if cfg.webshop_data and cfg.env != "webshop":
            raise ValueError(f"--webshop-data {cfg.webshop_data}: only for --env webshop (this run: --env {cfg.env})")
        from policy import autocast_dtype, load_critic, load_policy, pick_device, setup_device

        # ---- processes: one under plain python; under torchrun one per GPU/CPU share, all with the whole model
        # ---- model, reference, critic, optimizers, and the checkpoint to resume from: every input is read here
        device = dist.init(pick_device(cfg.device))
        if cfg.groups % dist.world_size():
            k = f" x --online-k {cfg.online_k}" if cfg.online_k > 1 else ""
            raise ValueError(f"--prompts {cfg.prompts}{k}: must be divisible by the number of processes "
                             f"({dist.world_size()}); a prompt group never splits across processes")
        setup_device(device, cfg.threads)
        policy, tok, path, env_overrides = load_model_and_env(cfg, device)
        critic = load_critic(path, device) if cfg.algo == "ppo" else None
        ref = copy.deepcopy(policy).eval().requires_grad_(False)  # the initial policy: KL anchor and monitor
        found = read_checkpoint(out, device) if cfg.resume else None
        start, state, ck = found or (0, None, None)
        if found:
            kept_metrics = read_metrics(out / "metrics.jsonl", start) if dist.is_main() else []
            policy.load_state_dict(load_policy(str(ck / "policy"), device, progress=False,
                                               flag_name=f"--resume {out}")[0].state_dict())
            if critic is not None:
                critic.load_state_dict(load_critic(str(ck / "critic"), device).state_dict())
    except ValueError as e:
        cli.fail(str(e))
    amp = autocast_dtype(device)
    opt = make_optimizer(policy, cfg.lr)
    critic_opt = make_optimizer(critic, cfg.critic_lr) if critic is not None else None
    # the imitation's own AdamW: a supervised step wants ~5x the RL step (betas as sft_baseline.py's tiny default)
    imit_opt = make_optimizer(policy, cfg.imitation_lr, weight_decay=0.0, betas=(0.9, 0.95)) \
        if cfg.hindsight_imitation else None
    monitor = EchoMonitor(**state["monitor"]) if found else EchoMonitor()
    if found:
        opt.load_state_dict(state["opt"])
        if critic is not None:
            critic_opt.load_state_dict(state["critic_opt"])
        if imit_opt is not None:
            imit_opt.load_state_dict(state["imit_opt"])
    ucfg = UpdateConfig(mini_batch=cfg.mini_batch, micro_batch=cfg.micro_batch, clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high, entropy_coef=cfg.entropy_coef, agg=cfg.loss_agg,
                        kl_coef=0.0 if cfg.kl_in_reward else cfg.kl_coef,  # in the rewards instead: measured only
                        kl_kind=cfg.kl_kind, temperature=cfg.temperature, fused=cfg.fused)
    train_rcfg, eval_rcfg = rollout_config(cfg, cfg.temperature), rollout_config(cfg, cfg.eval_temperature)

    # ---- the run folder, written from here on (rank 0 only)
    metrics_path = out / "metrics.jsonl"
    if dist.is_main():
        if cfg.overwrite and not cfg.resume and out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
        for old in out.glob("trajectories-*.txt"):  # dumps of iterations after the checkpoint are rewritten
            if int(old.stem.split("-")[1]) > start:
                old.unlink()
        metrics_path.write_text("".join(line + "\n" for line in kept_metrics) if found else "")
        print("config:", json.dumps(asdict(cfg)))
        if found:
            print(f"resumed from {ck} at iteration {start}")
        elif cfg.resume:
            print(f"no checkpoint in {out} yet: starting the run afresh")
    # DDP averages the ranks' gradients; it must wrap the module whose forward `update` calls: TokenLogprobs (see
    # starpo.py), not the HF model, whose backbone and head the fused path reaches directly. Without torchrun
    # both are the plain modules. Rollouts, eval and checkpoints keep using `policy` and `critic` themselves.
    train_policy, train_critic = dist.ddp(TokenLogprobs(policy), device), dist.ddp(critic, device)

    # ---- the loop
    from tqdm import tqdm
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="StarPO", dynamic_ncols=True,
               disable=not dist.is_main())
    stop_reason, saved_at = None, start if found else 0
    try:
        for it in bar:
            t0 = time.time()
            m: dict = {"step": it + 1}
            diverged = None  # why the policy can no longer be trained, if it cannot

            # 1. rollouts: P prompts x N rollouts (x online_k) in groups that share a room, on every rank
            trajs = iteration_rollouts(cfg, it, policy, tok, train_rcfg, env_overrides, device)
            rewards = torch.tensor([t.reward for t in trajs]).view(cfg.groups, cfg.rollouts)  # [G, N]
            s = summarize(trajs)
            m.update({f"rollout/{k}": s[k] for k in ("success", "num_actions", "valid_action", "effective_action",
                                                     "format", "turns", "truncated", "response_length")})
            m.update({"rollout/reward_mean": s["reward"], "rollout/reward_std": rewards.std().item(),
                      "time/rollout": time.time() - t0})

            # 2. StarPO-S uncertainty filter: whole groups in or out by in-group reward std (+ hindsight groups)
            kept, no_spread, fm = kept_trajectories(cfg, it, trajs, tok, train_rcfg, env_overrides)
            m.update(fm)
            # With every group's rewards equal, GRPO's advantages are all 0: the update would be a silent no-op, so it
            # is skipped and logged. PPO's are R - V(s): its policy, entropy bonus and critic still learn.
            skip = no_spread and cfg.algo == "grpo"
            m["train/skipped_zero_std"] = float(skip)

            if not skip:
                # 3. the batch: old and reference log-probs, values, advantages (no grad)
                t1 = time.time()
                batch, pm = prepare_batch(kept, cfg, policy, ref, critic, tok.pad_token_id, device, amp,
                                          on_eval=evaluates(cfg, it))
                m.update(pm)
                m["time/prep"] = time.time() - t1

                # 4. update: ppo_epochs passes over the batch, in mini-batches. The shuffle is the same on every rank
                #    (the same mini-batches); each rank trains its rows of each one, DDP sums them (starpo.update)
                t2 = time.time()
                policy.train()
                if critic is not None:
                    critic.train()
                passes = [update(train_policy, opt, batch, ucfg, critic=train_critic, critic_optimizer=critic_opt,
                                 generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + it * 101 + k),
                                 autocast_dtype=amp, shard=(dist.rank(), dist.world_size()))
                          for k in range(cfg.ppo_epochs)]
                counts = ("train/optimizer_steps", "train/skipped_nonfinite")  # summed over passes, the rest averaged
                m.update({k: (sum if k in counts else statistics.fmean)([p[k] for p in passes]) for k in passes[0]})
                m["train/rows"] = len(batch)
                m["time/update"] = time.time() - t2
                # an update that makes the weights non-finite (e.g. a far too high --lr) ends the run, logged first
                if not weights_finite(policy):
                    diverged = "the update made the policy's weights non-finite"
            elif dist.is_main():
                tqdm.write(f"[iter {it + 1}] every group has zero reward std: update skipped (logged)")

            # 4b. hindsight imitation (GCSL): every rollout that moved the box, as a success at where it left it
            # (--imitation-demos best: each room's shortest solved rollout)
            if cfg.hindsight_imitation and not diverged:
                t4 = time.time()
                demos = hindsight_demos(cfg, trajs, tok, train_rcfg, env_overrides)
                policy.train()
                m.update(imitate(cfg, it, demos, train_policy, imit_opt, ucfg, tok.pad_token_id, device, amp))
                m["time/imitation"] = time.time() - t4
                if not weights_finite(policy):
                    diverged = "the hindsight imitation made the policy's weights non-finite"

            # 5. Echo Trap monitor, eval, checkpoint, log: rank 0 only (its metrics are the global ones)
            if dist.is_main():
                warnings = echo_check(monitor, m)
                m["echo/warnings"] = len(warnings)
                for signal, w in warnings.items():
                    m[f"echo/{signal}"] = 1
                    tqdm.write(f"[iter {it + 1}] ECHO TRAP WARNING: {w}")
                if cfg.stop_on_collapse and warnings:
                    stop_reason = next(iter(warnings.values()))
                last = it + 1 == cfg.steps or stop_reason is not None
                if (evaluates(cfg, it) or last) and not diverged:
                    t3 = time.time()
                    try:
                        em, etrajs = evaluate(cfg.env, eval_rcfg, policy, tok, prompts=cfg.eval_prompts,
                                              seed=cfg.seed, env_overrides=env_overrides)
                        m.update({f"eval/{k}": v for k, v in em.items() if k != "episodes"})
                        m["time/eval"] = time.time() - t3
                        with open(out / f"trajectories-{it + 1:06d}.txt", "w") as f:
                            f.write("".join(dump(t, tok) + "\n" for t in etrajs[:cfg.dump_trajectories]))
                    except FloatingPointError as e:  # the line of this iteration is still written below
                        diverged = str(e)
                m["time/iteration"] = time.time() - t0
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(m) + "\n")
                if cfg.save_every and ((it + 1) % cfg.save_every == 0 or last) and not diverged:
                    save_checkpoint(out, it + 1, policy, tok, critic, opt, critic_opt, imit_opt, monitor, cfg)
                    saved_at = it + 1
                tqdm.write(line(m))
            if diverged:
                raise FloatingPointError(diverged)
            stop_reason = dist.broadcast_object(stop_reason)  # rank 0 decides; the others wait here meanwhile
            if stop_reason:
                if dist.is_main():
                    tqdm.write(f"stopping on collapse (--stop-on-collapse): {stop_reason}")
                break
    except FloatingPointError as e:  # a diverged policy can no longer sample; every logged line is kept
        where = f"{out}/ckpt-{saved_at:06d}" if saved_at else "none"
        cli.fail(f"iteration {it + 1}: {e} (--lr {cfg.lr} is too high?); the metrics so far are in {metrics_path}, "
                 f"the last checkpoint: {where}", code=1)
    except KeyboardInterrupt:
        bar.close()
        where = f"iteration {saved_at}" if saved_at else "none yet"
        raise KeyboardInterrupt(f"at iteration {it + 1} (last checkpoint: {where}); continue with: python train.py "
                                f"--resume {out}") from None
    bar.close()
    if dist.world_size() > 1:  # a DDP mistake shows as replicas drifting apart: check once, bitwise
        digest = dist.assert_in_sync(policy, critic)
        if dist.is_main():
            print(f"weights identical on all {dist.world_size()} processes (sha256 {digest})")
    if dist.is_main():
        save_final(out, policy, tok, cfg)
        print(f"final policy: {out / 'final'}")
    del train_policy, train_critic  # the DDP wrappers hold the process group, which close() frees
    dist.close()
    return out


def line(m: dict) -> str:
    """The one printed line per iteration."""
    keys = [("reward", "rollout/reward_mean"), ("succ", "rollout/success"), ("std", "rollout/in_group_std"),
            ("kept_std", "rollout/chosen_in_group_std"), ("fmt", "rollout/format"), ("ent", "train/entropy"),
            ("gnorm", "train/grad_norm"), ("kl0", "train/kl_to_init"), ("clip", "train/pg_clipfrac"),
            ("eval", "eval/success"), ("s", "time/iteration")]
    return " | ".join([f"it {m['step']}"] + [f"{n} {m[k]:.3g}" for n, k in keys if m.get(k) is not None])


if __name__ == "__main__":
    cli.run(main)
