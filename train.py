"""StarPO / StarPO-S training (paper sections 2-4): multi-turn rollouts -> variance filter -> PPO/GRPO update.

    python train.py --env sokoban --algo grpo --filter 0.25            # StarPO-S, the paper's recipe
    python train.py --preset starpo --env bandit                       # StarPO: no filter, KL 0.001, clip 0.2/0.2
    python train.py --env sokoban --algo ppo --model Qwen/Qwen2.5-0.5B-Instruct   # the paper's run, one GPU

One loop, top to bottom: P prompts x N rollouts (fresh training rooms, never eval rooms) -> keep the groups
with the largest in-group reward std (section 4.2) -> the batch: advantages (GRPO: group-normalised; PPO: GAE
with the critic) and the log-probs a loss needs -> mini-batch updates -> the Echo Trap monitor -> one JSONL
line and one printed line -> eval, checkpoint. Every model runs the paper's rendering and batch; only sizes
that follow the model (learning rates, steps, reply budget) differ. Every draw of iteration i derives from
(--seed, i), so --resume reproduces the uninterrupted run. Options beyond the paper are opt-in, named in the
first printed line, and live in extras/. Read next: sft_baseline.py (the same sections) or eval.py.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import statistics
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

import numpy as np
import torch

from advantages import broadcast_to_tokens, gae, grpo_advantages, kl_penalized_rewards, place_reward_on_last_token, whiten
from engine import cli
from engine import distributed as dist
from engine.checkpoint import read_checkpoint, read_metrics, resume_config, save_checkpoint, save_final
from engine.logprobs import TokenLogprobs, shared_prefix_len, token_logprobs
from engine.lora import adapters_off, add_lora
from engine.models import autocast_dtype, load_critic, load_model_and_env, load_policy, model_kind, pick_device
from engine.models import run_policy, setup_device
from envs import ENVS, train_seeds
from eval import evaluate, saved_rollout_settings, summarize
from filter import select_groups
from monitor import EchoMonitor, watch
from rollout import RolloutConfig, Segment, default_reply_tokens, dump, rollout, trained_mask
from starpo import AGG_MODES, Batch, UpdateConfig, make_optimizer, masked_mean, pad_segments, update

# The paper's rendering and batch (section 3.3, Appendix C.2): the defaults of every model and environment
PAPER = dict(think=True, context_turns=0, max_turns=5, max_actions_per_turn=5, prompts=8, rollouts=16)
PRESETS = {  # the paper's two recipes (section 4.2, Appendix C.2/D); flags typed explicitly win. StarPO's KL
    # is RAGEN's: k1, in the token rewards for PPO (apply_kl_penalty), a loss term for GRPO
    "starpo": dict(filter=1.0, kl_coef=0.001, kl_kind="k1", clip_low=0.2, clip_high=0.2, **PAPER),
    "starpo-s": dict(filter=0.25, kl_coef=0.0, clip_low=0.2, clip_high=0.28, **PAPER),
}
MODEL_DEFAULTS = {  # fields left at None: hub models the paper's (Appendix C.2), tiny what trains on a CPU
    "tiny": dict(lr=1e-4, critic_lr=1e-3, steps=30, eval_prompts=128, micro_batch=16, imitation_lr=2.5e-4),
    "hf": dict(lr=1e-6, critic_lr=1e-5, steps=200, eval_prompts=256, micro_batch=4, imitation_lr=5e-4),
}
flag = cli.flag


@dataclass
class Config:
    # ---- the paper's method (section 4.2, Appendix C.2)
    env: str = flag("sokoban", "environment", choices=ENVS)
    algo: str = flag("grpo", "advantage estimator: grpo (group-normalised), ppo (critic + GAE); beyond the "
                             "paper: gigpo (extras/gigpo.py)", choices=["grpo", "ppo", "gigpo"])
    preset: str | None = flag(None, "the paper's recipes, starpo or starpo-s (typed flags win)", choices=PRESETS)
    filter: float = flag(0.25, "share of prompt groups kept by in-group reward std (1 = all; with "
                               "--filter-strategy: its value)", gt=0)
    filter_smallest: bool = flag(False, "keep the LOWEST-std groups instead (the paper's ablation)")
    kl_coef: float = flag(0.0, "KL-to-initial-policy coefficient (StarPO: 0.001; StarPO-S: 0, KL measured)", lo=0)
    kl_kind: str = flag("k3", "KL estimator: k1 (RAGEN's `kl`, the paper's runs) or k3 (low-variance)",
                        choices=["k1", "k3"])
    kl_in_reward: bool | None = flag(None, "PPO: the KL in the token rewards (RAGEN's apply_kl_penalty), not "
                                           "the loss (default: on with --preset starpo --algo ppo)")
    clip_low: float = flag(0.2, "PPO clip eps_low", lo=0, lt=1)
    clip_high: float = flag(0.28, "PPO clip eps_high (Clip-Higher; StarPO: 0.2)", lo=0)
    entropy_coef: float = flag(0.001, "entropy bonus coefficient", lo=0)
    prompts: int | None = flag(None, "P: prompts (initial states) per iteration (paper: 8)", lo=1)
    rollouts: int | None = flag(None, "N: rollouts per prompt, a group (paper: 16)", lo=2)
    max_turns: int | None = flag(None, "turns per episode (paper: 5)", lo=1)
    max_actions_per_turn: int | None = flag(None, "actions per turn (paper: 5)", lo=1)
    max_actions: int = flag(10, "actions per episode", lo=1)
    max_new_tokens: int | None = flag(None, "tokens per reply (default: tiny 100; hub models RAGEN's 400, "
                                            "500 on bandit)", lo=1)
    format_penalty: float = flag(-0.1, "reward of a turn without a valid answer")
    think: bool | None = flag(None, "<think>...</think> before <answer> (--no-think: answer only; paper: on)")
    context_turns: int | None = flag(None, "history: 0 = the whole conversation (paper), K = the last K turns "
                                           "(RAGEN's later context window)", lo=0)
    gamma: float = flag(1.0, "GAE discount (PPO)", lo=0, hi=1)
    lam: float = flag(1.0, "GAE lambda (PPO)", lo=0, hi=1)
    grpo_std_norm: bool = flag(True, "GRPO divides by the group std (off: Dr.GRPO's mean-only)")
    mini_batch: int = flag(32, "training sequences per optimizer step", lo=1)
    ppo_epochs: int = flag(1, "passes over each rollout batch (the paper's runs: 1)", lo=1)
    online_k: int = flag(1, "RAGEN's Online-k (Figure 7): k x P prompts at once, each trajectory used once over "
                            "k times the optimizer steps (paper: 1)", lo=1)
    group_noise: str = flag("shared", "a group's rollouts meet the same payoffs/slips (shared: RAGEN's "
                                      "seeding) or their own (independent)", choices=["shared", "independent"])
    response_mask: bool = flag(True, "train only the sampled tokens (--no-response-mask: every token after "
                                     "the system prompt, as the paper's runs did)")
    loss_agg: str = flag("token-mean", "token losses to one: the mini-batch's token mean, or per sequence first "
                                       "(seq-mean-token-mean: the paper's 1/|tau| form)", choices=AGG_MODES)
    temperature: float = flag(1.0, "rollout sampling temperature", gt=0)
    lr: float | None = flag(None, "policy learning rate (default: tiny 1e-4, hub models 1e-6)", gt=0)
    critic_lr: float | None = flag(None, "critic learning rate, PPO (default: tiny 1e-3, hub models 1e-5)", gt=0)
    steps: int | None = flag(None, "training iterations (default: tiny 30, hub models 200)", lo=1)
    eval_every: int = flag(10, "evaluate every this many iterations (0 = only at the end)", lo=0)
    eval_prompts: int | None = flag(None, "eval prompts, <= 256 (default: tiny 128, hub models 256)", lo=1,
                                    hi=256)
    eval_temperature: float = flag(0.5, "eval sampling temperature (paper: 0.5)", lo=0)
    # ---- beyond the paper (opt-in; each named in the run's first line): extras/
    filter_strategy: str = flag("top_k", "RAGEN HEAD's rules: top_k (the paper), top_k_abs (--filter groups), "
                                         "top_p, min_p (extras/filter_rules.py)", beyond=True,
                                choices=["top_k", "top_k_abs", "top_p", "min_p"])
    filter_metric: str = flag("reward_std", "the score groups are ranked by", beyond=True,
                              choices=["reward_std", "reward_mean", "reward_sum"])
    filter_include_zero: bool = flag(True, "rank zero-score groups too (off: dropped first, RAGEN-2's guide)",
                                     beyond=True)
    filter_top_p_mode: str = flag("linear", "top_p over the cumulative score or its softmax mass",
                                  choices=["linear", "softmax"], beyond=True)
    filter_eps: float = flag(0.01, "top_p linear: taken off its threshold (RAGEN's selection_eps)", lo=0, beyond=True)
    filter_empty_stop: int = flag(0, "stop after this many iterations in a row whose filter kept no group "
                                     "(0 = never; RAGEN: 5)", lo=0, beyond=True)
    turn_rewards: bool = flag(False, "PPO: each turn's reward on its last reply token (RAGEN's turn scores; "
                                     "extras/turn_credit.py)", beyond=True)
    bi_level_gae: bool = flag(False, "PPO: a turn-level GAE over turn ends, then a token-level GAE inside "
                                     "each turn (RAGEN HEAD)", beyond=True)
    high_level_gamma: float = flag(0.95, "--bi-level-gae: the turn-level discount (RAGEN: 0.95)", lo=0, hi=1, beyond=True)
    dual_clip: float = flag(0.0, "dual clip C > 1 (verl's clip_ratio_c; RAGEN's runs: 3): a negative-advantage "
                                 "token's loss capped at -A x C (0 = off)", lo=0, beyond=True)
    collapse_every: int = flag(0, "RAGEN-2's template-collapse metrics on iteration 1 and every K (think mode; "
                                  "extras/collapse.py)", lo=0, beyond=True)
    collapse_samples: int = flag(64, "first turns cross-scored per collapse measurement (RAGEN: 64)", lo=2, beyond=True)
    hindsight_imitation: int = flag(0, "Sokoban: K supervised passes after each update over the rollouts "
                                       "relabelled as successes (GCSL, extras/hindsight.py)", lo=0, beyond=True)
    imitation_demos: str = flag("hindsight", "--hindsight-imitation's demos: hindsight (relabelled) or best "
                                             "(each room's shortest solved rollout)", choices=["hindsight", "best"], beyond=True)
    imitation_lr: float | None = flag(None, "--hindsight-imitation's learning rate (default: tiny 2.5e-4, hub "
                                            "models 5e-4)", gt=0)
    gigpo_weight: float = flag(1.0, "--algo gigpo: w, the step-level advantage's weight", lo=0, beyond=True)
    gigpo_gamma: float = flag(0.95, "--algo gigpo: the discount of the step-level returns", gt=0, hi=1, beyond=True)
    gigpo_mode: str = flag("mean_norm", "--algo gigpo: step groups centred (mean_norm) or also divided by "
                                        "their std (mean_std_norm)", choices=["mean_norm", "mean_std_norm"], beyond=True)
    # ---- the run, the model, memory
    seed: int = flag(0, "seed of everything (training rooms, sampling, mini-batch order)", lo=0, hi=cli.SEED_MAX)
    out: str | None = flag(None, "run folder (default: runs/ENV-ALGO-PRESET-sSEED); never overwritten but by "
                                 "--overwrite")
    resume: str | None = flag(None, "continue the run in this folder from its last checkpoint")
    overwrite: bool = flag(False, "replace the run already in --out (only the files a run writes)")
    model: str = flag("tiny", "tiny (the shipped prior), a hub id such as Qwen/Qwen2.5-0.5B-Instruct, a "
                              "folder, a run folder or a .gguf file")
    device: str = flag("auto", "auto (CUDA if present), cpu, cuda or cuda:N")
    threads: int = flag(1, "CPU threads (1 measured fastest for small models on 2-core machines)", lo=1)
    micro_batch: int | None = flag(None, "sequences per forward/backward (default: tiny 16, hub models 4)", lo=1)
    fused: bool = flag(True, "chunked log-probs that never build [B, T, V] logits (engine/logprobs.py)")
    save_every: int = flag(10, "checkpoint every this many iterations (0 = none, only final/)", lo=0)
    dump_trajectories: int = flag(3, "trajectories written as text at each eval", lo=0)
    stop_on_collapse: bool = flag(False, "end the run cleanly when the Echo Trap monitor fires")
    lora_rank: int = flag(0, "train LoRA adapters of this rank (policy and critic backbone), not every weight "
                             "(0 = every weight, the paper)", lo=0)
    lora_alpha: float = flag(32.0, "LoRA alpha (the update is scaled by alpha / rank)", gt=0)
    grad_checkpoint: bool = flag(False, "recompute each decoder layer's activations in backward (less memory)")
    memory_cap: float | None = flag(None, "CUDA: cap this process's GPU memory at this many GiB (does a run "
                                          "fit a 24 GB card?)", gt=0)
    webshop_data: str | None = flag(None, "folder with the original WebShop files (default: the shipped one)")
    plot: list[str] | None = flag(None, "draw the Echo Trap signals of these run folders into one PNG and exit")
    plot_out: str | None = flag(None, "where --plot writes (default: FIRST_RUN/echo_trap.png)")
    groups: int = field(default=0, metadata={"derived": True})  # prompt groups rolled out: P x online_k


RESUMABLE = {"steps", "device", "threads", "memory_cap"}  # the flags a resumed run may change


def derive(cfg: Config, explicit: set[str] = frozenset()) -> Config:
    """Per-model defaults, sizes that follow from the flags, the default run folder (ENV-ALGO-sSEED, then the
    preset and a digest of the other flags typed, so that different commands never collide), and one-line
    errors for bad values."""
    kind = model_kind(cfg.model)  # tiny-sized folders get the tiny defaults too
    cli.fill_defaults(cfg, {**PAPER, **MODEL_DEFAULTS[kind], "max_new_tokens": default_reply_tokens(kind, cfg.env),
                            "kl_in_reward": cfg.preset == "starpo" and cfg.algo == "ppo"})
    rules = [(not (cfg.kl_in_reward and cfg.algo != "ppo"), "--kl-in-reward: PPO only (GRPO has no token "
                                                             "rewards; its KL is a loss term)"),
             (cfg.filter <= 1 or cfg.filter_strategy == "top_k_abs", f"--filter {cfg.filter}: must be <= 1 with "
              f"--filter-strategy {cfg.filter_strategy} (a share; top_k_abs takes a number of groups)"),
             (cfg.micro_batch <= cfg.mini_batch, f"--micro-batch {cfg.micro_batch}: larger than --mini-batch "
                                                 f"{cfg.mini_batch} (a micro-batch is a part of a mini-batch)"),
             (not cfg.webshop_data or cfg.env == "webshop", f"--webshop-data {cfg.webshop_data}: only for --env "
                                                            f"webshop (this run: --env {cfg.env})")]
    if cli.opt_ins(cfg) or cfg.algo == "gigpo":
        from extras.options import rules as beyond_rules  # beyond the paper: only when a run asks for it
        rules += beyond_rules(cfg)
    cli.check(cli.bounds(cfg) + rules)
    cfg.groups = cfg.prompts * cfg.online_k
    if cfg.out is None:
        same = {"env", "algo", "seed", "preset", "steps", "device", "threads", "overwrite", "resume", "out"}
        typed = {f.name: getattr(cfg, f.name) for f in fields(Config) if f.name in explicit - same
                 and getattr(cfg, f.name) != f.default}
        digest = hashlib.sha1(json.dumps(typed, sort_keys=True).encode()).hexdigest()[:6] if typed else ""
        cfg.out = "-".join(x for x in (f"runs/{cfg.env}-{cfg.algo}-s{cfg.seed}", cfg.preset, digest) if x)
    return cfg


def describe(cfg: Config, device) -> str:
    """The run's first printed line: the method in words (StarPO-S when it has the paper's three changes,
    StarPO when it has none), the options beyond the paper it uses, then env, model and device."""
    changes = (cfg.filter < 1, cfg.kl_coef == 0, cfg.clip_high > cfg.clip_low)
    extra, modified = "", False
    if cli.opt_ins(cfg) or cfg.algo == "gigpo":
        from extras.options import describe as beyond
        extra, modified = beyond(cfg)
    name = "StarPO-S" if all(changes) else "StarPO" if not any(changes) else "StarPO (modified)"
    name += " (modified)" if modified and not name.endswith(")") else ""
    kl = f"KL {cfg.kl_coef:g} ({'in the rewards' if cfg.kl_in_reward else 'in the loss'})" if cfg.kl_coef \
        else "no KL"
    kept = "all" if cfg.filter >= 1 else f"{'bottom' if cfg.filter_smallest else 'top'} {cfg.filter:.0%} of"
    kept = kept if cfg.filter_strategy == "top_k" else f"{cfg.filter_strategy} {cfg.filter:g} of"
    model = "tiny policy" if cfg.model == "tiny" else cfg.model
    return (f"{name}: {cfg.algo.upper()}, {kept} {cfg.groups} groups by {cfg.filter_metric.replace('_', ' ')}, "
            f"{kl}, clip {cfg.clip_low:g}/{cfg.clip_high:g}{extra} | {cfg.env} | {model} | {device}")


def inherit_rendering(cfg: Config, explicit: set[str]) -> Config:
    """A --model saved by train.py or sft_baseline.py is trained on prompts rendered as it was trained
    (history window, think mode, budgets: its train_config.json), unless a flag says otherwise."""
    cfg = replace(cfg, model=run_policy(cfg.model, "--model"))
    inherited = {k: v for k, v in saved_rollout_settings(cfg.model, "--model").items() if k not in explicit}
    if inherited and dist.is_main():
        print(f"rollout settings of {cfg.model}: {json.dumps(inherited)}")
    return replace(cfg, **inherited)


def seed_of(cfg: Config, it: int, stream: int | None = None) -> int:
    """The seed of a generator of iteration `it` (sampling, the collapse sample; `stream` k: the update's k-th
    pass, 77 the imitation): every draw derives from (--seed, it), so a resumed run needs no saved state."""
    return cfg.seed * 1_000_003 + (it if stream is None else it * 101 + stream)


# ------------------------------------------------------------------------------------------------- the loop

def iteration_rollouts(cfg: Config, it: int, policy, tok, rcfg: RolloutConfig, env_kw: dict, device) -> list:
    """Iteration `it`'s rollouts, in group order: every rollout of a prompt shares its room (a group) and,
    with --group-noise shared, its luck. Rooms come from (seed, it). Under torchrun each rank rolls out its
    whole groups, sampling from seed + rank << 40, then every rank holds all of them (the filter ranks all)."""
    gen = torch.Generator(device=device).manual_seed(seed_of(cfg, it) + (dist.rank() << 40))
    seeds = train_seeds(np.random.default_rng([cfg.seed, it]), cfg.groups)
    mine = dist.my_range(cfg.groups)
    samples = [k if cfg.group_noise == "independent" else 0 for _ in mine for k in range(cfg.rollouts)]
    policy.eval()
    trajs = rollout(cfg.env, [seeds[g] for g in mine for _ in range(cfg.rollouts)],
                    [g for g in mine for _ in range(cfg.rollouts)], rcfg, tokenizer=tok, model=policy,
                    generator=gen, env_overrides=env_kw, samples=samples)
    return dist.all_gather_objects(trajs)


def filter_groups(cfg: Config, trajs: list):
    """StarPO-S's filter (section 4.2): whole groups in or out by in-group reward std. -> (kept trajectories,
    why the update is skipped or None, metrics). GRPO with no reward spread in any group has all-zero
    advantages, and an empty selection has no rows: either update would be a silent no-op, so it is skipped
    and logged. PPO's advantages are R - V: it updates."""
    rewards = torch.tensor([t.reward for t in trajs]).view(cfg.groups, cfg.rollouts)  # [G, N]
    if cfg.filter_strategy == "top_k" and cfg.filter_metric == "reward_std" and cfg.filter_include_zero:
        keep, fs = select_groups(rewards, keep=cfg.filter, largest=not cfg.filter_smallest)
    else:  # beyond the paper: RAGEN's later rules
        from extras.filter_rules import select_groups_by_rule
        keep, fs = select_groups_by_rule(rewards, cfg.filter, not cfg.filter_smallest, cfg.filter_strategy,
                                         cfg.filter_include_zero, cfg.filter_top_p_mode, cfg.filter_eps,
                                         cfg.filter_metric)
    m = {f"rollout/{k}": fs[k] for k in ("in_group_std", "in_group_std_max", "chosen_in_group_std",
                                         "filter_kept", "zero_std_groups")}
    zero = fs["all_zero_std"] and cfg.algo == "grpo"
    m.update({"train/skipped_zero_std": float(zero), "train/skipped_empty_filter": float(fs["empty_selection"])})
    skip = "the filter kept no group" if fs["empty_selection"] else "every group has zero reward std" \
        if zero else None
    return [t for t in trajs if keep[t.group_id]], skip, m


@torch.no_grad()
def prepare_batch(kept, cfg: Config, policy, ref, critic, pad_id: int, device, amp, on_eval: bool):
    """The update's inputs from the kept trajectories (section 2.2, Appendix A): rows, old and reference
    log-probs where a loss needs them, values, advantages. -> (Batch, metrics). Under torchrun each rank runs
    its share of the rows and every rank ends with the whole batch (GAE and whitening see all of it)."""
    rows = [(s, t) for t in kept for s in t.segments]  # one row per segment (a trajectory, or a turn's window)
    ids, attn, mask = (x.to(device) for x in pad_segments(
        [Segment(s.input_ids, trained_mask(s, cfg.response_mask)) for s, _ in rows], pad_id))  # [B, T] each
    pre = shared_prefix_len([s.input_ids for s, _ in rows])  # the prompt header, run once

    def logp(model, base_only=False):  # base_only: a LoRA policy's frozen base, its KL reference
        def fn(i, a):
            with adapters_off(model) if base_only else contextlib.nullcontext():
                return token_logprobs(model, i, a, cfg.temperature, cfg.fused, prefix_len=pre)[0].float()
        return fn
    # Only passes whose answer is not known run: one optimizer step on fresh rollouts has ratio 1, so update()
    # takes the old log-probs from its own forward; without a KL term the reference feeds train/kl_to_init,
    # measured on the iterations that evaluate.
    one_step = len(ids) <= cfg.mini_batch and cfg.ppo_epochs == 1 and not cfg.kl_in_reward
    run = lambda fn: dist.map_rows(fn, ids, attn, cfg.micro_batch)  # noqa: E731
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        old_logp = None if one_step else run(logp(policy))                                        # [B, T]
        ref_logp = run(logp(policy, True) if ref is None else logp(ref)) if cfg.kl_coef or on_eval else None
        values = run(lambda i, a: critic(i, a).float()) if critic is not None else None           # [B, T]
    metrics, returns = {}, None
    if cfg.algo != "ppo":  # GRPO: each row's trajectory reward, normalised in its group, on its sampled tokens
        scores = grpo_advantages(torch.tensor([t.reward for t in kept]), [t.group_id for t in kept],
                                 norm_by_std=cfg.grpo_std_norm)
        row_adv = torch.tensor([a for t, a in zip(kept, scores.tolist()) for _ in t.segments])  # [B]
        adv = broadcast_to_tokens(row_adv.to(device), mask)
        if cfg.algo == "gigpo":  # beyond the paper: + the step-level advantage of each turn (extras/gigpo.py)
            from extras.gigpo import gigpo_token_advantages
            adv, metrics = gigpo_token_advantages(kept, rows, mask, cfg)
    else:  # PPO: the trajectory reward on each row's last sampled token, GAE with the critic
        rewards, ends = place_reward_on_last_token(torch.tensor([t.reward for _, t in rows]).to(device), mask), None
        if cfg.turn_rewards or cfg.bi_level_gae:  # beyond the paper: each turn credited at its end
            from extras.turn_credit import turn_credit
            rewards, ends = turn_credit(rows, rewards, cfg, ids.shape[1])
        if cfg.kl_in_reward:  # StarPO with PPO as the paper ran it (RAGEN's apply_kl_penalty)
            rewards = kl_penalized_rewards(rewards, old_logp, ref_logp, mask, cfg.kl_coef)
            metrics["train/kl_in_reward"] = masked_mean(old_logp - ref_logp, mask).item()
        if ends is None:
            adv, returns = gae(rewards, values, mask, cfg.gamma, cfg.lam)
        else:
            from extras.turn_credit import bi_level_gae
            adv, returns = bi_level_gae(rewards, values, mask, ends, cfg.gamma, cfg.lam, cfg.high_level_gamma)
        adv = whiten(adv, mask)  # over the global batch: every rank holds all of it
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=mask, advantages=adv, old_logp=old_logp,
                 ref_logp=ref_logp, returns=returns, old_values=values, prefix_len=pre), metrics


def weights_finite(policy) -> bool:
    """Whether every weight of the policy is finite (one host sync, after a phase that stepped an optimizer)."""
    return bool(torch.stack([torch.isfinite(p).all() for p in policy.parameters()]).all())


def evaluates(cfg: Config, it: int) -> bool:
    """Whether iteration `it` (0-based) ends with an eval: every eval_every iterations and the last one."""
    return bool(cfg.eval_every and (it + 1) % cfg.eval_every == 0) or it + 1 == cfg.steps


def run_eval(cfg: Config, it: int, out: Path, policy, tok, rcfg: RolloutConfig, env_kw: dict) -> dict:
    """The paper's eval (section 3.3) on the fixed prompts; a few episodes written as text. -> eval/ metrics."""
    t0 = time.time()
    em, etrajs = evaluate(cfg.env, rcfg, policy, tok, prompts=cfg.eval_prompts, seed=cfg.seed,
                          env_overrides=env_kw)
    (out / f"trajectories-{it + 1:06d}.txt").write_text("".join(dump(t, tok) + "\n"
                                                                for t in etrajs[:cfg.dump_trajectories]))
    return {**{f"eval/{k}": v for k, v in em.items() if k != "episodes"}, "time/eval": time.time() - t0}


# ------------------------------------------------------------------------------------------------- main

def main(argv=None):
    # ---- 1. config and every input, checked before anything is written
    try:
        cfg, explicit = cli.parse(Config, argv, description=__doc__.split("\n")[0], presets=PRESETS)
        if cfg.plot:
            from tools.plot import plot_runs
            return print(plot_runs(cfg.plot, cfg.plot_out))
        cfg = derive(resume_config(Config, cfg, explicit, RESUMABLE, dropped=("groups_kept", "hindsight"))
                     if cfg.resume else inherit_rendering(cfg, explicit), explicit)
        out = Path(cfg.out) if cfg.resume else cli.run_folder(cfg.out, "--out", cfg.overwrite, resumable=True)
        found = read_checkpoint(out, "cpu") if cfg.resume else None
        start, state, ck = found or (0, None, None)
        if cfg.resume and cfg.steps < start:
            raise ValueError(f"--steps {cfg.steps}: the run already has {start} iterations (give at least that)")
        # ---- 2. processes (one per GPU under torchrun), the policy, its KL reference, the critic
        device = dist.init(pick_device(cfg.device))
        if cfg.groups % dist.world_size():
            k = f" x --online-k {cfg.online_k}" if cfg.online_k > 1 else ""
            raise ValueError(f"--prompts {cfg.prompts}{k}: must be divisible by the number of processes "
                             f"({dist.world_size()}); a prompt group never splits across processes")
        setup_device(device, cfg.threads, cfg.memory_cap)
        policy, tok, path, env_kw = load_model_and_env(cfg, device)
        critic = load_critic(path, device) if cfg.algo == "ppo" else None
        ref = None if cfg.lora_rank else copy.deepcopy(policy).eval().requires_grad_(False)  # the KL anchor
        kept_metrics = read_metrics(out / "metrics.jsonl", start) if found and dist.is_main() else None
        memory_levers(cfg, policy, critic, ck, state)
    except ValueError as e:
        cli.fail(str(e))
    amp = autocast_dtype(device)
    opt, critic_opt, imit_opt, monitor = optimizers(cfg, policy, critic, state)
    ucfg = UpdateConfig(mini_batch=cfg.mini_batch, micro_batch=cfg.micro_batch, clip_low=cfg.clip_low,
                        clip_high=cfg.clip_high, entropy_coef=cfg.entropy_coef, agg=cfg.loss_agg,
                        kl_coef=0.0 if cfg.kl_in_reward else cfg.kl_coef,  # in the rewards: measured only
                        kl_kind=cfg.kl_kind, temperature=cfg.temperature, fused=cfg.fused,
                        dual_clip=cfg.dual_clip or None)
    train_rcfg, eval_rcfg = RolloutConfig.of(cfg, cfg.temperature), RolloutConfig.of(cfg, cfg.eval_temperature)
    metrics_path = open_run_folder(cfg, out, start, kept_metrics, device, ck)
    # DDP (torchrun) wraps what `update` calls: TokenLogprobs, not the HF model (without torchrun: plain)
    train_policy, train_critic = dist.ddp(TokenLogprobs(policy), device), dist.ddp(critic, device)

    # ---- 3. the loop
    from tqdm import tqdm
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc=describe(cfg, "").split(":")[0],
               dynamic_ncols=True, disable=not dist.is_main())
    stop, saved_at, it, empty_run = None, start, start, 0
    try:
        for it in bar:
            t0, m, diverged = time.time(), {"step": it + 1}, None

            # 1. rollouts: P prompts x N rollouts (x online_k), in groups that share a room
            trajs = iteration_rollouts(cfg, it, policy, tok, train_rcfg, env_kw, device)
            s = summarize(trajs)
            m.update({f"rollout/{k}": s[k] for k in ("success", "num_actions", "valid_action", "effective_action",
                                                     "format", "turns", "truncated", "response_length")})
            m.update({"rollout/reward_mean": s["reward"], "time/rollout": time.time() - t0,
                      "rollout/reward_std": torch.tensor([t.reward for t in trajs]).std().item()})
            if cfg.collapse_every and it % cfg.collapse_every == 0 and dist.is_main():  # RAGEN-2, extras/
                from extras.collapse import measure_collapse
                m.update(measure_collapse(policy, tok, trajs, cfg.collapse_samples, seed_of(cfg, it), amp,
                                          cfg.temperature))

            # 2. StarPO-S's filter: whole groups in or out by in-group reward std
            kept, skip, fm = filter_groups(cfg, trajs)
            m.update(fm)
            empty_run = empty_run + 1 if fm["train/skipped_empty_filter"] else 0
            if skip and dist.is_main():
                tqdm.write(f"[iter {it + 1}] {skip}: update skipped (logged)")
            if not skip:
                # 3. the batch: advantages, the log-probs a loss needs (no grad)
                t1 = time.time()
                batch, pm = prepare_batch(kept, cfg, policy, ref, critic, tok.pad_token_id, device, amp,
                                          on_eval=evaluates(cfg, it))
                m.update({**pm, "time/prep": time.time() - t1})
                # 4. update: ppo_epochs passes in mini-batches, the same on every rank (starpo.update)
                t2 = time.time()
                policy.train()
                if critic is not None:
                    critic.train()
                passes = [update(train_policy, opt, batch, ucfg, critic=train_critic, critic_optimizer=critic_opt,
                                 generator=torch.Generator().manual_seed(seed_of(cfg, it, k)), autocast_dtype=amp,
                                 shard=(dist.rank(), dist.world_size())) for k in range(cfg.ppo_epochs)]
                counts = ("train/optimizer_steps", "train/skipped_nonfinite")  # summed over passes
                m.update({k: (sum if k in counts else statistics.fmean)([p[k] for p in passes]) for k in passes[0]})
                m.update({"train/rows": len(batch), "time/update": time.time() - t2})
                diverged = None if weights_finite(policy) else "the update made the policy's weights non-finite"

            # 4b. beyond the paper: hindsight imitation (GCSL, extras/hindsight.py)
            if cfg.hindsight_imitation and not diverged:
                from extras.hindsight import imitation_step
                t4 = time.time()
                m.update(imitation_step(cfg.env, trajs, cfg.hindsight_imitation, cfg.imitation_demos, train_policy,
                                        imit_opt, ucfg, tok, train_rcfg, env_kw, cfg.response_mask,
                                        torch.Generator().manual_seed(seed_of(cfg, it, 77)), amp))
                m["time/imitation"] = time.time() - t4
                diverged = None if weights_finite(policy) else "the imitation made the policy's weights non-finite"

            # 5. Echo Trap monitor, eval, log, checkpoint: rank 0 (its metrics are the global ones)
            if dist.is_main():
                warnings = watch(monitor, m)
                for w in warnings:
                    tqdm.write(f"[iter {it + 1}] ECHO TRAP WARNING: {w}")
                stop = warnings[0] if cfg.stop_on_collapse and warnings else None
                if cfg.filter_empty_stop and empty_run >= cfg.filter_empty_stop:
                    stop = f"the filter kept no group {empty_run} iterations in a row (--filter-empty-stop)"
                last = it + 1 == cfg.steps or stop is not None
                if (evaluates(cfg, it) or last) and not diverged:
                    try:
                        m.update(run_eval(cfg, it, out, policy, tok, eval_rcfg, env_kw))
                    except FloatingPointError as e:  # this iteration's line is still written below
                        diverged = str(e)
                m.update(memory_metrics(device), **{"time/iteration": time.time() - t0})
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(m) + "\n")
                if cfg.save_every and ((it + 1) % cfg.save_every == 0 or last) and not diverged:
                    save_checkpoint(out, it + 1, tok, {"policy": policy, "critic": critic}, {
                        "opt": opt.state_dict(), "monitor": asdict(monitor),
                        **{k: o.state_dict() for k, o in (("critic_opt", critic_opt), ("imit_opt", imit_opt)) if o}},
                        config=asdict(cfg))
                    saved_at = it + 1
                tqdm.write(line(m))
            if diverged:
                raise FloatingPointError(diverged)
            stop = dist.broadcast_object(stop)  # rank 0 decides; the others wait here meanwhile
            if stop:
                dist.is_main() and tqdm.write(f"stopping: {stop}")
                break
    except FloatingPointError as e:  # a diverged policy can no longer sample; every logged line is kept
        where = f"{out}/ckpt-{saved_at:06d}" if saved_at else "none"
        cli.fail(f"iteration {it + 1}: {e} (--lr {cfg.lr} is too high?); the metrics so far are in "
                 f"{metrics_path}, the last checkpoint: {where}", code=1)
    except KeyboardInterrupt:
        bar.close()
        raise KeyboardInterrupt(f"at iteration {it + 1} (last checkpoint: "
                                f"{f'iteration {saved_at}' if saved_at else 'none yet'}); continue with: "
                                f"python train.py --resume {out}") from None
    bar.close()
    del train_policy, train_critic  # the DDP wrappers hold the process group, which finish() closes
    return finish(cfg, out, policy, tok, critic)


# ------------------------------------------------------------------------------------------- around the loop

def memory_levers(cfg: Config, policy, critic, ck, state) -> None:
    """--lora-rank and --grad-checkpoint on the policy and the critic's backbone; when resuming, the weights
    (a LoRA run: its adapters) from the checkpoint `ck`."""
    torch.manual_seed(cfg.seed)  # the adapters' random init: the same in a run and its resumed copy
    for model in (policy, critic.backbone if critic is not None else None):
        if model is not None and cfg.lora_rank:
            add_lora(model, cfg.lora_rank, cfg.lora_alpha)
        if model is not None and cfg.grad_checkpoint:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if ck is None:
        return
    device = policy.device
    if cfg.lora_rank:  # the frozen base is --model's; the adapters are in state.pt
        policy.load_state_dict(state["policy_lora"], strict=False)
    else:
        policy.load_state_dict(load_policy(str(ck / "policy"), device, f"--resume {cfg.out}")[0].state_dict())
    if critic is not None and cfg.lora_rank:  # the head beside the merged backbone, the adapters from state.pt
        critic.value_head.load_state_dict(torch.load(ck / "critic" / "value_head.pt", map_location=device))
        critic.load_state_dict(state["critic_lora"], strict=False)
    elif critic is not None:
        critic.load_state_dict(load_critic(str(ck / "critic"), device).state_dict())


def optimizers(cfg: Config, policy, critic, state: dict | None):
    """The policy's AdamW, the critic's (PPO), the imitation's (--hindsight-imitation) and the Echo Trap
    monitor, restored from a checkpoint's state when resuming."""
    opt = make_optimizer(policy, cfg.lr)
    critic_opt = make_optimizer(critic, cfg.critic_lr) if critic is not None else None
    imit_opt = None
    if cfg.hindsight_imitation:
        from extras.hindsight import make_imitation_optimizer
        imit_opt = make_imitation_optimizer(policy, cfg.imitation_lr)
    if state is None:
        return opt, critic_opt, imit_opt, EchoMonitor()
    for o, key in ((opt, "opt"), (critic_opt, "critic_opt"), (imit_opt, "imit_opt")):
        if o is not None:
            o.load_state_dict(state[key])
    return opt, critic_opt, imit_opt, EchoMonitor(**state["monitor"])


def open_run_folder(cfg: Config, out: Path, start: int, kept_metrics, device, ck) -> Path:
    """Rank 0: the first printed line, config.json and the metrics kept from before the checkpoint (a run
    being replaced is cleared first, only now that its inputs are good). -> metrics.jsonl's path."""
    metrics_path = out / "metrics.jsonl"
    if dist.is_main():
        print(describe(cfg, device))
        if cfg.overwrite and not cfg.resume:
            cli.clear_run_folder(out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(asdict(cfg), indent=2))
        for old in out.glob("trajectories-*.txt"):  # dumps of iterations after the checkpoint are rewritten
            if int(old.stem.split("-")[1]) > start:
                old.unlink()
        metrics_path.write_text("".join(line + "\n" for line in kept_metrics or []))
        print("config:", json.dumps(asdict(cfg)))
        print(f"resumed from {ck} at iteration {start}" if ck else f"no checkpoint in {out} yet: starting the "
              f"run afresh" if cfg.resume else f"writing {out}")
    return metrics_path


def memory_metrics(device) -> dict:
    """CUDA: the allocator's peaks so far (GiB), allocated and reserved; nothing on a CPU."""
    if device.type != "cuda":
        return {}
    return {"memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / 2 ** 30,
            "memory/peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2 ** 30}


def finish(cfg: Config, out: Path, policy, tok, critic) -> Path:
    """After the loop: the replicas checked identical (torchrun), final/ written, the process group closed."""
    if dist.world_size() > 1:  # a DDP mistake shows as replicas drifting apart: check once, bitwise
        digest = dist.assert_in_sync(policy, critic)
        dist.is_main() and print(f"weights identical on all {dist.world_size()} processes (sha256 {digest})")
    if dist.is_main():
        save_final(out, policy, tok, cfg)
        print(f"final policy: {out / 'final'}")
    dist.close()
    return out


def line(m: dict) -> str:
    """The one printed line per iteration (docs/metrics.md)."""
    keys = [("reward", "rollout/reward_mean"), ("succ", "rollout/success"), ("std", "rollout/in_group_std"),
            ("kept_std", "rollout/chosen_in_group_std"), ("fmt", "rollout/format"), ("ent", "train/entropy"),
            ("gnorm", "train/grad_norm"), ("kl0", "train/kl_to_init"), ("mi", "collapse/mi"),
            ("clip", "train/pg_clipfrac"), ("eval", "eval/success"), ("s", "time/iteration")]
    return " | ".join([f"it {m['step']}"] + [f"{n} {m[k]:.3g}" for n, k in keys if m.get(k) is not None])


if __name__ == "__main__":
    cli.run(main)
