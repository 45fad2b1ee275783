"""StarPO / StarPO-S training (paper sections 2-4): multi-turn rollouts -> variance filter -> PPO/GRPO update.

    python train.py --env sokoban --algo grpo --filter 0.25            # StarPO-S (the paper's recipe), tiny policy
    python train.py --preset starpo --env bandit                       # the StarPO baseline (no filter, KL, 0.2/0.2)
    python train.py --env sokoban --algo ppo --model Qwen/Qwen2.5-0.5B-Instruct   # the paper's run, 1 GPU
    python train.py --plot runs/a runs/b                               # Echo Trap signals of several runs, one PNG

One loop, top to bottom: sample P prompts (fresh training seeds, never eval seeds) x N rollouts -> keep the
prompt groups with the largest in-group reward std (StarPO-S, section 4.2) -> the batch: advantages (GRPO:
group-normalised; PPO: GAE with the critic), old and reference log-probs where a pass needs them -> one pass of
mini-batch updates -> the Echo Trap monitor (monitor.py) -> one JSONL line + one printed line -> eval, checkpoint.
Every model, the tiny one included, runs the paper's rendering and batch (`<think>`, 5 turns x 5 actions, 10 per
episode, 8 x 16); only sizes that follow the model (learning rates, steps, reply budget, micro-batch) differ.

Deviations from the paper / RAGEN (deliberate):
1. All randomness of iteration i (training seeds, sampling, mini-batch order) derives from (seed, i), so
   `--resume` reproduces an uninterrupted run without saving generator states.
2. `--model tiny` has its own sizes (lr 1e-4, 30 iterations, 128 eval prompts, micro-batches of 16) for a 2-core
   CPU; hub models get the paper's (lr 1e-6, critic 1e-5, 200 iterations, 256 eval prompts).
3. Only needed passes run, on the kept groups only: no old log-probs when the kept rows are one optimizer step
   (ratio exactly 1); without a KL term the reference only on eval iterations, for `train/kl_to_init` (verl: all).
4. The default trains only the sampled tokens (`--response-mask`, RAGEN's later default); the paper's runs
   trained every token after the system prompt (`--no-response-mask`).
5. A batch whose groups all have zero reward std is logged (`train/skipped_zero_std`) and, for GRPO, skipped:
   its advantages would all be 0. PPO's are R - V: it updates.
6. The KL reference is the initial policy, kept in memory (as verl's ref model); with `--lora-rank` it is the
   policy with its adapters off (lora.adapters_off, verl's ref_in_actor): no second copy of the weights.
7. Under torchrun (distributed.py; RAGEN: verl + Ray) each rank rolls out P / W whole groups, then all is gathered:
   the filter, advantages and metrics run on the same data; rank r samples with seed + r * 2**40; only rank 0
   logs, evaluates and writes checkpoints.
8. `--hindsight-imitation K` (off; neither the paper nor RAGEN has it): GCSL after each update, hindsight.py;
   `--imitation-demos best`: expert iteration instead (the RL-from-SFT recipe).
9. Memory levers for one GPU (off; the paper's runs train every weight on several GPUs): `--lora-rank R` (lora.py)
   on the policy and the critic's backbone, `--grad-checkpoint` (activations recomputed per decoder layer) and
   `--memory-cap GIB` (the allocator capped, to prove on a large card that a run fits a small one).
10. RAGEN's later code, each opt-in and named in the first printed line: the filter's rules (`--filter-strategy`,
   `--filter-metric`, `--no-filter-include-zero`, `--filter-empty-stop`; an empty selection skips the update,
   logged), `--turn-rewards` and `--bi-level-gae` (PPO), `--dual-clip`, and RAGEN-2's template-collapse metrics
   (`--collapse-every K`, measured on the rollouts before the update; off by default, unlike RAGEN's every 5).
"""
from __future__ import annotations

import contextlib
import copy
import json
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
import hindsight
from advantages import (at_positions, bi_level_gae, broadcast_to_tokens, gae, grpo_advantages,
                        kl_penalized_rewards, place_reward_on_last_token, whiten)
from envs import ENVS, train_seeds
from eval import ROLLOUT_KEYS, evaluate, saved_rollout_settings, summarize
from filter import METRICS, STRATEGIES, TOP_P_MODES, select_groups
from lora import adapters_off, add_lora
from checkpoint import read_checkpoint, read_metrics, save_checkpoint, save_final
from monitor import EchoMonitor, measure_collapse, watch
from policy import autocast_dtype, load_critic, load_policy, model_kind, pad_segments, pick_device, setup_device
from rollout import RolloutConfig, Segment, default_reply_tokens, dump, rollout, trained_mask
from starpo import (AGG_MODES, Batch, TokenLogprobs, UpdateConfig, make_optimizer, masked_mean, shared_prefix_len,
                    token_logprobs, update)

# The paper's rendering and batch (section 3.3, Appendix C.2): the defaults of every model and environment
PAPER_DEFAULTS = dict(think=True, context_turns=0, max_turns=5, max_actions_per_turn=5, prompts=8, rollouts=16)
PRESETS = {  # the paper's two recipes (section 4.2, Appendix C.2/D), rendering and batch included; flags typed
    # explicitly win. StarPO's KL is RAGEN's: k1 (`kl`), in the token rewards for PPO (apply_kl_penalty), a loss
    # term for GRPO (see derive)
    "starpo": dict(filter=1.0, kl_coef=0.001, kl_kind="k1", clip_low=0.2, clip_high=0.2, **PAPER_DEFAULTS),
    "starpo-s": dict(filter=0.25, kl_coef=0.0, clip_low=0.2, clip_high=0.28, **PAPER_DEFAULTS),
}
# Per-model defaults for fields left at None (deviation 2). Qwen: the paper's (Appendix C.2). tiny: what trains on
# a CPU. imitation_lr: hindsight.py's supervised step (tiny: measured on the GCSL recipe, docs/results.md).
MODEL_DEFAULTS = {
    "tiny": dict(lr=1e-4, critic_lr=1e-3, steps=30, eval_prompts=128, micro_batch=16, imitation_lr=2.5e-4),
    "hf": dict(lr=1e-6, critic_lr=1e-5, steps=200, eval_prompts=256, micro_batch=4, imitation_lr=5e-4),
}

@dataclass
class Config:
    env: str = cli.flag("sokoban", "environment", choices=ENVS)
    algo: str = cli.flag("grpo", "advantage estimator: grpo (group-normalised) or ppo (critic + GAE)",
                         choices=["grpo", "ppo"])
    preset: str | None = cli.flag(None, "the paper's recipes: starpo or starpo-s (explicit flags override)",
                                  choices=sorted(PRESETS))
    filter: float = cli.flag(0.25, "fraction of prompt groups kept by in-group reward std (1.0 = off); with "
                                   "--filter-strategy: its value (top_k_abs: a number of groups)", gt=0)
    filter_smallest: bool = cli.flag(False, "keep the LOWEST-variance groups instead (the paper's ablation)")
    filter_strategy: str = cli.flag("top_k", "beyond the paper (RAGEN HEAD, RAGEN-2): top_k (the paper: the top "
                                    "--filter fraction), top_k_abs (--filter groups), top_p (groups in score order "
                                    "until --filter x the total score), min_p (score >= --filter x the largest)",
                                    choices=list(STRATEGIES))
    filter_metric: str = cli.flag("reward_std", "the score groups are ranked by (paper: reward_std)",
                                  choices=list(METRICS))
    filter_include_zero: bool = cli.flag(True, "rank zero-score groups too (--no-filter-include-zero drops them "
                                               "first, as RAGEN-2's guide recommends)")
    filter_top_p_mode: str = cli.flag("linear", "top_p over the cumulative score (linear) or softmax mass",
                                      choices=list(TOP_P_MODES))
    filter_eps: float = cli.flag(0.01, "top_p linear: subtracted from its threshold (RAGEN's selection_eps)", lo=0)
    filter_empty_stop: int = cli.flag(0, "end the run after this many iterations in a row whose filter kept no "
                                         "group (each is skipped and logged; 0 = never; RAGEN: 5)", lo=0)
    turn_rewards: bool = cli.flag(False, "PPO, beyond the paper: each turn's reward on its own last reply token "
                                         "(RAGEN's turn scores) instead of the trajectory's on the last one")
    bi_level_gae: bool = cli.flag(False, "PPO, beyond the paper (RAGEN HEAD): a turn-level GAE over turn ends, then "
                                         "a token-level GAE inside each turn")
    high_level_gamma: float = cli.flag(0.95, "--bi-level-gae: the turn-level discount (RAGEN: 0.95)", lo=0, hi=1)
    dual_clip: float = cli.flag(0.0, "dual clip C (verl's clip_ratio_c; RAGEN's runs: 3.0): a negative-advantage "
                                     "token's loss is capped at -A x C; 0 = off (the paper)", lo=0)
    collapse_every: int = cli.flag(0, "RAGEN-2's template-collapse metrics (collapse/mi, ...) on iteration 1 and every"
                                      " K iterations, think mode only (0 = off)", lo=0)
    collapse_samples: int = cli.flag(64, "first turns cross-scored per collapse measurement (RAGEN: 64)", lo=2)
    hindsight_imitation: int = cli.flag(0, "beyond the paper (hindsight.py, GCSL), Sokoban: after each update, this "
                                           "many supervised passes over the iteration's rollouts, each relabelled as "
                                           "a success with the target where it left the box; 0 = off", lo=0)
    imitation_demos: str = cli.flag("hindsight", "what --hindsight-imitation learns from: hindsight (every rollout "
                                    "that moved the box, relabelled) or best (each room's shortest solved rollout)",
                                    choices=["hindsight", "best"])
    imitation_lr: float | None = cli.flag(None, "learning rate of --hindsight-imitation (its own AdamW; default: tiny "
                                                "2.5e-4, hub models 5e-4)", gt=0)
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
    prompts: int | None = cli.flag(None, "P: prompts (initial states) per iteration (paper: 8)",
                                   lo=1)
    rollouts: int | None = cli.flag(None, "N: rollouts per prompt, a group (paper: 16)", lo=2)
    max_turns: int | None = cli.flag(None, "turns per episode (paper: 5)", lo=1)
    max_actions_per_turn: int | None = cli.flag(None, "actions per turn (paper: 5)", lo=1)
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
    think: bool | None = cli.flag(None, "<think>...</think> before <answer> (--no-think: answer only; paper: "
                                        "on)")
    context_turns: int | None = cli.flag(None, "history window: 0 = whole conversation (paper), K = last K turns "
                                               "(RAGEN's later context window)", lo=0)
    steps: int | None = cli.flag(None, "training iterations (default: tiny 30, hub models 200)", lo=1)
    eval_every: int = cli.flag(10, "evaluate every this many iterations (0 = only at the end)", lo=0)
    eval_prompts: int | None = cli.flag(None, "eval prompts, <= 256 (default: tiny 128, hub models 256)", lo=1, hi=256)
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
    lora_rank: int = cli.flag(0, "beyond the paper: train LoRA adapters of this rank (policy and PPO critic "
                                 "backbone) instead of every weight; 0 = every weight (paper)", lo=0)
    lora_alpha: float = cli.flag(32.0, "LoRA alpha (the update is scaled by alpha / rank)", gt=0)
    grad_checkpoint: bool = cli.flag(False, "recompute each decoder layer's activations in the backward pass: "
                                            "less GPU memory, a slower update")
    memory_cap: float | None = cli.flag(None, "CUDA: cap this process's GPU memory at this many GiB (24: prove "
                                              "that a run fits a 24 GB card on a larger one)", gt=0)
    webshop_data: str | None = cli.flag(None, "folder with the original WebShop files (default: shipped catalogue)")
    plot: list[str] | None = cli.flag(None, "draw the Echo Trap signals of these run folders into one PNG and exit")
    plot_out: str | None = cli.flag(None, "where --plot writes its PNG (default: FIRST_RUN/echo_trap.png)")
    # derived right after parsing
    groups: int = field(default=0, metadata={"derived": True})       # prompt groups rolled out: P x online_k
    groups_kept: int = field(default=0, metadata={"derived": True})


def derive(cfg: Config) -> Config:
    """Per-model defaults, sizes that follow from the flags, and one-line errors for bad values."""
    kind = model_kind(cfg.model)  # tiny-sized folders get the tiny defaults too
    cli.fill_defaults(cfg, {**PAPER_DEFAULTS, **MODEL_DEFAULTS[kind],
                            "max_new_tokens": default_reply_tokens(kind, cfg.env),
                            "kl_in_reward": cfg.preset == "starpo" and cfg.algo == "ppo"})
    allowed = ", ".join(sorted(n for n in ENVS if hindsight.supported(n)))
    cli.check(cli.bounds(cfg) + [
        (not (cfg.kl_in_reward and cfg.algo == "grpo"), "--kl-in-reward: PPO only (GRPO has no token rewards; its KL "
                                                        "is a loss term, RAGEN's kl_loss_type)"),
        (not cfg.hindsight_imitation or hindsight.supported(cfg.env), f"--hindsight-imitation {cfg.hindsight_imitation}: "
         f"only for {allowed} (this run: --env {cfg.env}; 0 turns it off)"),
        (cfg.imitation_demos == "hindsight" or cfg.hindsight_imitation, f"--imitation-demos {cfg.imitation_demos}: "
         f"the demos of --hindsight-imitation K, which is 0 in this run (give K >= 1)"),
        (not cfg.webshop_data or cfg.env == "webshop", f"--webshop-data {cfg.webshop_data}: only for --env webshop "
                                                       f"(this run: --env {cfg.env})"),
        (cfg.filter <= 1 or cfg.filter_strategy == "top_k_abs", f"--filter {cfg.filter}: must be <= 1 with "
         f"--filter-strategy {cfg.filter_strategy} (a fraction; top_k_abs takes a number of groups)"),
        (cfg.filter_strategy != "top_k_abs" or float(cfg.filter).is_integer(), f"--filter {cfg.filter}: "
         f"--filter-strategy top_k_abs keeps a whole number of groups"),
        (cfg.algo == "ppo" or not cfg.bi_level_gae, "--bi-level-gae: PPO only (it needs the critic's values)"),
        (cfg.algo == "ppo" or not cfg.turn_rewards, "--turn-rewards: PPO only (GRPO credits the trajectory)"),
        (not cfg.turn_rewards or cfg.context_turns == 0, f"--turn-rewards: needs --context-turns 0 (one training "
                                                         f"row per trajectory), got {cfg.context_turns}"),
        (not cfg.bi_level_gae or cfg.response_mask, "--bi-level-gae: needs --response-mask (turns end at sampled "
                                                    "tokens)"),
        (not cfg.collapse_every or cfg.think, f"--collapse-every {cfg.collapse_every}: needs think mode (it scores "
                                              f"the reasoning between <think> and </think>); this run has --no-think"),
        (cfg.dual_clip == 0 or cfg.dual_clip > 1, f"--dual-clip {cfg.dual_clip}: must be > 1 (verl's clip_ratio_c; "
                                                  f"0 = off)")])
    cfg.groups = cfg.prompts * cfg.online_k
    cfg.groups_kept = {"top_k": max(1, int(cfg.filter * cfg.groups)),  # 0: it varies (top_p, min_p)
                       "top_k_abs": min(int(cfg.filter), cfg.groups)}.get(cfg.filter_strategy, 0)
    cfg.out = cfg.out if cfg.out is not None else f"runs/{cfg.env}-{cfg.algo}-s{cfg.seed}"
    return cfg


def method_name(cfg: Config) -> str:
    """StarPO-S when the run has the paper's three changes (filter, no KL, Clip-Higher), StarPO when it has none."""
    changes = (cfg.filter < 1, cfg.kl_coef == 0, cfg.clip_high > cfg.clip_low)
    name = "StarPO-S" if all(changes) else "StarPO" if not any(changes) else "StarPO (modified)"
    return name if name.endswith(")") or not beyond_paper(cfg) else f"{name} (modified)"


def beyond_paper(cfg: Config) -> list[str]:
    """The options of RAGEN's later code this run turns on (none: the paper's method)."""
    return [k for k, on in (("filter " + cfg.filter_strategy, cfg.filter_strategy != "top_k"),
                            ("by " + cfg.filter_metric, cfg.filter_metric != "reward_std"),
                            ("no zero groups", not cfg.filter_include_zero), ("turn rewards", cfg.turn_rewards),
                            ("bi-level GAE", cfg.bi_level_gae), (f"dual clip {cfg.dual_clip:g}", cfg.dual_clip > 0))
            if on]


def describe(cfg: Config, device) -> str:
    """The run's first printed line: the method in words, then env, model and device."""
    kl = f"KL {cfg.kl_coef:g} ({'in the rewards' if cfg.kl_in_reward else 'in the loss'})" if cfg.kl_coef else "no KL"
    kept = "all" if cfg.filter >= 1 else f"{'bottom' if cfg.filter_smallest else 'top'} {cfg.filter:.0%} of"
    kept = kept if cfg.filter_strategy == "top_k" else f"{cfg.filter_strategy} {cfg.filter:g} of"
    extra = f" + hindsight imitation x{cfg.hindsight_imitation} (GCSL, beyond the paper)" \
        if cfg.hindsight_imitation else ""
    extra += f" + {', '.join(beyond_paper(cfg))} (RAGEN's later code)" if beyond_paper(cfg) else ""
    model = "tiny policy" if cfg.model == "tiny" else cfg.model
    return (f"{method_name(cfg)}: {cfg.algo.upper()}, {kept} {cfg.groups} groups by {cfg.filter_metric.replace('_', ' ')}, {kl}, clip "
            f"{cfg.clip_low:g}/{cfg.clip_high:g}{extra} | {cfg.env} | {model} | {device}")



def inherit_rendering(cfg: Config, explicit: set[str]) -> Config:
    """A --model folder saved by train.py or sft_baseline.py is trained on prompts rendered as it was trained
    (history window, think mode, budgets, from its train_config.json), unless a flag says otherwise."""
    inherited = {k: v for k, v in saved_rollout_settings(cfg.model, "--model").items() if k not in explicit}
    if inherited and os.environ.get("RANK", "0") == "0":  # before the process group exists: torchrun's variable
        print(f"rollout settings of {cfg.model}: {json.dumps(inherited)}")
    return replace(cfg, **inherited)


def load_model_and_env(cfg, device):
    """-> (policy, tokenizer, its path, env overrides), checked before a run writes anything."""
    with dist.main_first():  # rank 0 builds (tiny) or downloads the model into the cache, then the others load
        policy, tok, path = load_policy(cfg.model, device)
    positions = getattr(policy.config, "max_position_embeddings", None)
    if positions is not None and cfg.max_new_tokens >= positions:
        raise ValueError(f"--max-new-tokens {cfg.max_new_tokens}: the model reads at most {positions} positions")
    hidden = getattr(policy.config, "hidden_size", None)
    if cfg.lora_rank and hidden and cfg.lora_rank > hidden:
        raise ValueError(f"--lora-rank {cfg.lora_rank}: must be <= the model's hidden size {hidden} (0 = off)")
    env_overrides = {"data_dir": cfg.webshop_data} if cfg.webshop_data else {}
    ENVS[cfg.env](**env_overrides)
    return policy, tok, path, env_overrides


def memory_levers(cfg: Config, policy, critic, ck, state) -> None:
    """--lora-rank and --grad-checkpoint on the policy and the critic (deviation 9); a LoRA run's adapters and a
    run's weights restored from its checkpoint `ck` when resuming."""
    torch.manual_seed(cfg.seed)  # the adapters' random init (lora.py): the same in a run and its resumed copy
    for model in (policy, critic.backbone if critic is not None else None):
        if model is not None and cfg.lora_rank:
            add_lora(model, cfg.lora_rank, cfg.lora_alpha)
        if model is not None and cfg.grad_checkpoint:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if ck is None:
        return
    if cfg.lora_rank:  # the frozen base is the --model's; the adapters are in state.pt
        policy.load_state_dict(state["lora"], strict=False)
    else:
        policy.load_state_dict(load_policy(str(ck / "policy"), policy.device, flag_name=f"--resume {cfg.out}")[0]
                               .state_dict())
    if critic is not None:
        if cfg.lora_rank:  # the head beside the merged backbone, the adapters from state.pt
            critic.value_head.load_state_dict(torch.load(ck / "critic" / "value_head.pt", map_location=policy.device))
            critic.load_state_dict(state["critic_lora"], strict=False)
        else:
            critic.load_state_dict(load_critic(str(ck / "critic"), policy.device).state_dict())


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




def filter_groups(cfg: Config, trajs: list):
    """The StarPO-S filter (section 4.2): the groups with the largest in-group reward std, whole groups in or out
    (or RAGEN's later rules, --filter-strategy). -> (kept trajectories, why the update is skipped or None, metrics).
    GRPO with no reward spread in any group has all-zero advantages, and an empty selection has no rows: either
    update would be a silent no-op, so it is skipped and logged. PPO's advantages are R - V: it updates."""
    rewards = torch.tensor([t.reward for t in trajs]).view(cfg.groups, cfg.rollouts)  # [G, N]
    keep, fstats = select_groups(rewards, keep=cfg.filter, largest=not cfg.filter_smallest,
                                 strategy=cfg.filter_strategy, include_zero=cfg.filter_include_zero,
                                 top_p_mode=cfg.filter_top_p_mode, selection_eps=cfg.filter_eps,
                                 metric=cfg.filter_metric)
    m = {f"rollout/{k}": fstats[k] for k in ("in_group_std", "in_group_std_max", "chosen_in_group_std",
                                             "filter_kept", "zero_std_groups")}
    zero = fstats["all_zero_std"] and cfg.algo == "grpo"
    m.update({"train/skipped_zero_std": float(zero), "train/skipped_empty_filter": float(fstats["empty_selection"])})
    skip = "the filter kept no group" if fstats["empty_selection"] else \
        "every group has zero reward std" if zero else None
    return [t for t in trajs if keep[t.group_id]], skip, m


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
    rows = [(s, a, t) for t, a in zip(kept, adv_traj.tolist()) for s in t.segments]  # one row per segment
    ids, attn, mask = (x.to(device) for x in pad_segments(
        [Segment(s.input_ids, trained_mask(s, cfg.response_mask)) for s, _, _ in rows], pad_id))  # [B, T] each
    row_scores = torch.tensor([t.reward for _, _, t in rows])             # [B] each row's trajectory reward
    row_adv = torch.tensor([a for _, a, _ in rows], dtype=torch.float)  # [B] its GRPO advantage (PPO: zeros)
    pre = shared_prefix_len([s.input_ids for s, _, _ in rows])  # the prompt header, run once
    mine = dist.my_range(len(ids))

    def run(fn):  # fn(ids, attn) -> [b, T] on this rank's rows (B may be 0), micro-batch by micro-batch -> [B, T]
        my_ids, my_attn, micro = ids[mine.start:mine.stop], attn[mine.start:mine.stop], cfg.micro_batch
        parts = [fn(my_ids[j:j + micro], my_attn[j:j + micro]) for j in range(0, len(my_ids), micro)]
        return dist.gather_rows(torch.cat(parts) if parts else torch.zeros(my_ids.shape, device=device), len(ids))

    def logp(model, base_only=False):  # base_only: a LoRA policy's frozen base, its reference (deviation 6)
        def fn(i, a):
            with adapters_off(model) if base_only else contextlib.nullcontext():
                return token_logprobs(model, i, a, cfg.temperature, cfg.fused, prefix_len=pre)[0].float()
        return fn
    # No forward pass whose answer is known: one optimizer step on these fresh rollouts has ratio 1, so update()
    # takes the old log-probs from its own forward. Without a KL term the reference only feeds the
    # train/kl_to_init monitor, measured on the iterations that evaluate.
    one_step = len(ids) <= cfg.mini_batch and cfg.ppo_epochs == 1 and not cfg.kl_in_reward
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        old_logp = None if one_step else run(logp(policy))                                  # [B, T]
        ref_fn = logp(policy, base_only=True) if ref is None else logp(ref)
        ref_logp = run(ref_fn) if cfg.kl_coef > 0 or on_eval else None                      # [B, T]
        values = run(lambda i, a: critic(i, a).float()) if critic is not None else None     # [B, T]
    metrics = {}
    if cfg.algo == "grpo":
        adv, returns = broadcast_to_tokens(row_adv.to(device), mask), None
    else:  # the trajectory reward on each row's last trained token (or each turn's on its end); GAE over them
        ends = [s.reply_ends for s, _, _ in rows]  # [B] lists: each turn's last sampled token, from the rollout
        token_rewards = at_positions([[u.reward for u in t.turns[:len(e)]] for (_, _, t), e in zip(rows, ends)], ends,
                                     ids.shape[1]).to(device) if cfg.turn_rewards else \
            place_reward_on_last_token(row_scores.to(device), mask)
        if cfg.kl_in_reward:  # StarPO with PPO as the paper ran it (RAGEN's apply_kl_penalty)
            token_rewards = kl_penalized_rewards(token_rewards, old_logp, ref_logp, mask, cfg.kl_coef)
            metrics["train/kl_in_reward"] = masked_mean(old_logp - ref_logp, mask).item()
        if cfg.bi_level_gae:  # RAGEN HEAD: turn-level GAE over the turn ends, token-level inside each turn
            turn_ends = at_positions([[1.0] * len(e) for e in ends], ends, ids.shape[1]).to(device) > 0
            adv, returns = bi_level_gae(token_rewards, values, mask, turn_ends, cfg.gamma, cfg.lam,
                                        cfg.high_level_gamma)
        else:
            adv, returns = gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
        adv = whiten(adv, mask)  # over the global batch: every rank holds all of it
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=mask, advantages=adv, old_logp=old_logp,
                 ref_logp=ref_logp, returns=returns, old_values=values, prefix_len=pre), metrics




# ------------------------------------------------------------------------------------------- checkpoints

RESUMABLE = {"resume", "steps", "device", "threads", "memory_cap"}  # the flags a resumed run may change


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
    if saved.get("hindsight") is False:  # a removed flag (HER groups), at its off value
        saved.pop("hindsight")
    saved.setdefault("imitation_demos", "hindsight")
    saved.setdefault("hindsight_imitation", 0)  # a run saved before the flag existed ran without it
    return Config(**{**saved, **{k: getattr(cfg, k) for k in explicit}, "out": cfg.resume})


def optimizers(cfg: Config, policy, critic, state: dict | None):
    """The policy's AdamW, the critic's (PPO), the imitation's (--hindsight-imitation) and the Echo Trap monitor,
    restored from a checkpoint's state when resuming."""
    opt = make_optimizer(policy, cfg.lr)
    critic_opt = make_optimizer(critic, cfg.critic_lr) if critic is not None else None
    imit_opt = hindsight.make_imitation_optimizer(policy, cfg.imitation_lr) if cfg.hindsight_imitation else None
    if state is None:
        return opt, critic_opt, imit_opt, EchoMonitor()
    for o, key in ((opt, "opt"), (critic_opt, "critic_opt"), (imit_opt, "imit_opt")):
        if o is not None:
            o.load_state_dict(state[key])
    return opt, critic_opt, imit_opt, EchoMonitor(**state["monitor"])


def open_run_folder(cfg: Config, out: Path, start: int, kept_metrics: list[str] | None) -> Path:
    """Write config.json and the metrics kept from before the checkpoint (rank 0); -> metrics.jsonl's path."""
    metrics_path = out / "metrics.jsonl"
    if dist.is_main():
        if cfg.overwrite and not cfg.resume and out.exists():
            cli.clear_run_folder(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
        for old in out.glob("trajectories-*.txt"):  # dumps of iterations after the checkpoint are rewritten
            if int(old.stem.split("-")[1]) > start:
                old.unlink()
        metrics_path.write_text("".join(line + "\n" for line in kept_metrics or []))
        print("config:", json.dumps(asdict(cfg)))
    return metrics_path


def run_eval(cfg: Config, it: int, out: Path, policy, tok, eval_rcfg: RolloutConfig, env_overrides: dict) -> dict:
    """The paper's eval (section 3.3) on the fixed prompts; a few episodes written as text. -> eval/ metrics."""
    t0 = time.time()
    em, etrajs = evaluate(cfg.env, eval_rcfg, policy, tok, prompts=cfg.eval_prompts, seed=cfg.seed,
                          env_overrides=env_overrides)
    with open(out / f"trajectories-{it + 1:06d}.txt", "w") as f:
        f.write("".join(dump(t, tok) + "\n" for t in etrajs[:cfg.dump_trajectories]))
    return {**{f"eval/{k}": v for k, v in em.items() if k != "episodes"}, "time/eval": time.time() - t0}


def finish(cfg: Config, out: Path, policy, tok, critic) -> Path:
    """After the loop: the replicas checked identical (torchrun), final/ written, the process group closed."""
    if dist.world_size() > 1:  # a DDP mistake shows as replicas drifting apart: check once, bitwise
        digest = dist.assert_in_sync(policy, critic)
        if dist.is_main():
            print(f"weights identical on all {dist.world_size()} processes (sha256 {digest})")
    if dist.is_main():
        save_final(out, policy, tok, cfg)
        print(f"final policy: {out / 'final'}")
    dist.close()
    return out


# ------------------------------------------------------------------------------------------- main

def main(argv=None):
    # ---- config: the flags (or, with --resume, the run's own config), and every input, read before anything is written
    try:
        cfg, explicit = cli.parse(Config, argv, description=__doc__.split("\n")[0], presets=PRESETS)
        if cfg.plot:
            from plot import plot_runs
            print(plot_runs(cfg.plot, cfg.plot_out))
            return None
        cfg = derive(resume_config(cfg, explicit) if cfg.resume else inherit_rendering(cfg, explicit))
        out = Path(cfg.out) if cfg.resume else cli.run_folder(cfg.out, "--out", cfg.overwrite, resumable=True)
        # ---- processes (one under plain python; under torchrun one per GPU/CPU share), model, reference, critic
        device = dist.init(pick_device(cfg.device))
        if cfg.groups % dist.world_size():
            k = f" x --online-k {cfg.online_k}" if cfg.online_k > 1 else ""
            raise ValueError(f"--prompts {cfg.prompts}{k}: must be divisible by the number of processes "
                             f"({dist.world_size()}); a prompt group never splits across processes")
        setup_device(device, cfg.threads, cfg.memory_cap)
        policy, tok, path, env_overrides = load_model_and_env(cfg, device)
        critic = load_critic(path, device) if cfg.algo == "ppo" else None
        ref = None if cfg.lora_rank else copy.deepcopy(policy).eval().requires_grad_(False)  # KL anchor (dev. 6)
        found = read_checkpoint(out, device) if cfg.resume else None
        start, state, ck = found or (0, None, None)
        kept_metrics = read_metrics(out / "metrics.jsonl", start) if found and dist.is_main() else None
        memory_levers(cfg, policy, critic, ck, state)
    except ValueError as e:
        cli.fail(str(e))
    amp = autocast_dtype(device)
    opt, critic_opt, imit_opt, monitor = optimizers(cfg, policy, critic, state)
    ucfg = UpdateConfig(mini_batch=cfg.mini_batch, micro_batch=cfg.micro_batch, clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high, entropy_coef=cfg.entropy_coef, agg=cfg.loss_agg,
                        kl_coef=0.0 if cfg.kl_in_reward else cfg.kl_coef,  # in the rewards instead: measured only
                        kl_kind=cfg.kl_kind, temperature=cfg.temperature, fused=cfg.fused,
                        dual_clip=cfg.dual_clip or None)
    train_rcfg, eval_rcfg = rollout_config(cfg, cfg.temperature), rollout_config(cfg, cfg.eval_temperature)

    # ---- the run folder, written from here on (rank 0 only)
    if dist.is_main():
        print(describe(cfg, device))
    metrics_path = open_run_folder(cfg, out, start, kept_metrics)
    if dist.is_main():
        print(f"resumed from {ck} at iteration {start}" if found else
              f"no checkpoint in {out} yet: starting the run afresh" if cfg.resume else f"writing {out}")
    # DDP (torchrun) wraps the module whose forward `update` calls: TokenLogprobs (starpo.py), not the HF model.
    # Without torchrun both are the plain modules; rollouts, eval and checkpoints use `policy` and `critic`.
    train_policy, train_critic = dist.ddp(TokenLogprobs(policy), device), dist.ddp(critic, device)

    # ---- the loop
    from tqdm import tqdm
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=method_name(cfg), dynamic_ncols=True,
               disable=not dist.is_main())
    stop_reason, saved_at, it, empty_run = None, start if found else 0, start, 0
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
            if cfg.collapse_every and it % cfg.collapse_every == 0 and dist.is_main():  # RAGEN-2: before the update
                m.update(measure_collapse(policy, tok, trajs, cfg.collapse_samples, cfg.seed * 1_000_003 + it, amp,
                                          cfg.temperature))

            # 2. StarPO-S uncertainty filter: whole groups in or out by in-group reward std
            kept, skip, fm = filter_groups(cfg, trajs)  # skip: why this update would be a silent no-op, if so
            m.update(fm)
            empty_run = empty_run + 1 if fm["train/skipped_empty_filter"] else 0
            if skip and dist.is_main():
                tqdm.write(f"[iter {it + 1}] {skip}: update skipped (logged)")
            if not skip:
                # 3. the batch: old and reference log-probs, values, advantages (no grad)
                t1 = time.time()
                batch, pm = prepare_batch(kept, cfg, policy, ref, critic, tok.pad_token_id, device, amp,
                                          on_eval=evaluates(cfg, it))
                m.update({**pm, "time/prep": time.time() - t1})

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
                m.update({"train/rows": len(batch), "time/update": time.time() - t2})
                # an update that makes the weights non-finite (e.g. a far too high --lr) ends the run, logged first
                diverged = None if weights_finite(policy) else "the update made the policy's weights non-finite"

            # 4b. beyond the paper, opt-in: hindsight imitation (GCSL, hindsight.py)
            if cfg.hindsight_imitation and not diverged:
                t4 = time.time()
                gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + it * 101 + 77)
                m.update(hindsight.imitation_step(cfg.env, trajs, cfg.hindsight_imitation, cfg.imitation_demos,
                                                  train_policy, imit_opt, ucfg, tok, train_rcfg, env_overrides,
                                                  cfg.response_mask, gen, amp))
                m["time/imitation"] = time.time() - t4
                if not weights_finite(policy):
                    diverged = "the hindsight imitation made the policy's weights non-finite"

            # 5. Echo Trap monitor, eval, checkpoint, log: rank 0 only (its metrics are the global ones)
            if dist.is_main():
                warnings = watch(monitor, m)
                for w in warnings:
                    tqdm.write(f"[iter {it + 1}] ECHO TRAP WARNING: {w}")
                stop_reason = warnings[0] if cfg.stop_on_collapse and warnings else None
                if cfg.filter_empty_stop and empty_run >= cfg.filter_empty_stop:
                    stop_reason = f"the filter kept no group {empty_run} iterations in a row (--filter-empty-stop)"
                last = it + 1 == cfg.steps or stop_reason is not None
                if (evaluates(cfg, it) or last) and not diverged:
                    try:
                        m.update(run_eval(cfg, it, out, policy, tok, eval_rcfg, env_overrides))
                    except FloatingPointError as e:  # the line of this iteration is still written below
                        diverged = str(e)
                m["time/iteration"] = time.time() - t0
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(m) + "\n")
                if cfg.save_every and ((it + 1) % cfg.save_every == 0 or last) and not diverged:
                    save_checkpoint(out, it + 1, policy, tok, critic, opt, critic_opt, imit_opt, monitor, cfg.save_every)
                    saved_at = it + 1
                tqdm.write(line(m))
            if diverged:
                raise FloatingPointError(diverged)
            stop_reason = dist.broadcast_object(stop_reason)  # rank 0 decides; the others wait here meanwhile
            if stop_reason:
                if dist.is_main():
                    tqdm.write(f"stopping: {stop_reason}")
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
    del train_policy, train_critic  # the DDP wrappers hold the process group, which finish() closes
    return finish(cfg, out, policy, tok, critic)


def line(m: dict) -> str:
    """The one printed line per iteration."""
    keys = [("reward", "rollout/reward_mean"), ("succ", "rollout/success"), ("std", "rollout/in_group_std"),
            ("kept_std", "rollout/chosen_in_group_std"), ("fmt", "rollout/format"), ("ent", "train/entropy"),
            ("gnorm", "train/grad_norm"), ("kl0", "train/kl_to_init"), ("mi", "collapse/mi"), ("clip", "train/pg_clipfrac"),
            ("eval", "eval/success"), ("s", "time/iteration")]
    return " | ".join([f"it {m['step']}"] + [f"{n} {m[k]:.3g}" for n, k in keys if m.get(k) is not None])


if __name__ == "__main__":
    cli.run(main)
