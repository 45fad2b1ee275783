"""StarPO / StarPO-S training (paper sections 2-4): multi-turn rollouts -> variance filter -> PPO/GRPO update.

    python train.py --env sokoban --algo grpo --filter 0.25  # StarPO-S, the paper's recipe
    python train.py --preset starpo --env bandit  # StarPO: no filter, KL 0.001, clip 0.2/0.2
    python train.py --env sokoban --algo ppo --model Qwen/Qwen2.5-0.5B-Instruct  # the paper's run, one GPU

One iteration: P prompts x N rollouts -> keep the groups with the largest in-group reward std (section 4.2)
-> advantages (GRPO: group-normalised; PPO: GAE with a critic) -> mini-batch updates -> the Echo Trap
monitor, a JSONL line, eval, checkpoint. Every draw of iteration i derives from (--seed, i), so --resume
reproduces the uninterrupted run. Options beyond the paper are opt-in, in extras/. Next: sft_baseline.py.
"""
from __future__ import annotations

import json
import time
from statistics import fmean as mean
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from advantages import broadcast_to_tokens, gae, grpo_advantages, kl_penalized_rewards, whiten
from advantages import place_reward_on_last_token as reward_on_last
from engine import cli, distributed as dist
from engine.checkpoint import resume_config, save_checkpoint
from engine.logprobs import TokenLogprobs, pad_logps, pad_segments, shared_prefix_len, token_logprobs
from engine.lora import adapters_off
from engine.models import autocast_dtype, default_reply_tokens, memory_metrics, model_kind, visiting
from engine.report import describe, iteration_line
from engine.run import finish_run, inherit_rendering, start_run
from envs import ENVS, train_seeds
from eval import eval_metrics, summarize
from filter import select_groups
from monitor import watch
from rollout import ROLLOUT_KEYS, RolloutConfig, Segment, rollout, trained_mask
from starpo import AGG_MODES, Batch, UpdateConfig, masked_mean, update

ALGOS, NOISE = ["grpo", "ppo", "gigpo"], ["shared", "independent"]
METRICS = ["reward_std", "reward_mean", "reward_sum"]
PAPER = dict(think=True, context_turns=0, max_turns=5, max_actions_per_turn=5, prompts=8, rollouts=16)
PRESETS = {  # the paper's recipes (section 4.2, App. C.2); StarPO's KL is RAGEN's k1
    "starpo": dict(filter=1.0, kl_coef=0.001, kl_kind="k1", clip_low=0.2, clip_high=0.2, **PAPER),
    "starpo-s": dict(filter=0.25, kl_coef=0.0, clip_low=0.2, clip_high=0.28, **PAPER)}
MODEL_DEFAULTS = {  # fields left at None: hub models the paper's (App. C.2), tiny what trains on a CPU
    "tiny": dict(lr=1e-4, critic_lr=1e-3, steps=30, eval_prompts=128, micro_batch=16, imitation_lr=2.5e-4),
    "hf": dict(lr=1e-6, critic_lr=1e-5, steps=200, eval_prompts=256, micro_batch=4, imitation_lr=5e-4)}
flag = cli.flag


@dataclass
class Config:
    # ---- the paper's method (section 4.2, Appendix C.2)
    env: str = flag("sokoban", "environment", choices=ENVS)
    algo: str = flag("grpo", "grpo, ppo (critic + GAE); beyond the paper: gigpo", choices=ALGOS)
    preset: str | None = flag(None, "the paper's recipes (typed flags win)", choices=PRESETS)
    filter: float = flag(0.25, "share of groups kept by in-group reward std (1 = all)", gt=0)
    filter_smallest: bool = flag(False, "keep the LOWEST-std groups (the paper's ablation)")
    kl_coef: float = flag(0.0, "KL-to-initial-policy coefficient (StarPO: 0.001)", lo=0)
    kl_kind: str = flag("k3", "KL estimator: k1 (RAGEN's `kl`, the paper's runs), k3", choices=["k1", "k3"])
    kl_in_reward: bool | None = flag(None, "PPO: the KL in the rewards (default: with --preset starpo)")
    clip_low: float = flag(0.2, "PPO clip eps_low", lo=0, lt=1)
    clip_high: float = flag(0.28, "PPO clip eps_high (Clip-Higher; StarPO: 0.2)", lo=0)
    entropy_coef: float = flag(0.001, "entropy bonus coefficient", lo=0)
    prompts: int | None = flag(None, "P: prompts per iteration (paper: 8)", lo=1)
    rollouts: int | None = flag(None, "N: rollouts per prompt (paper: 16)", lo=2)
    max_turns: int | None = flag(None, "turns per episode (paper: 5)", lo=1)
    max_actions_per_turn: int | None = flag(None, "actions per turn (paper: 5)", lo=1)
    max_actions: int = flag(10, "actions per episode", lo=1)
    max_new_tokens: int | None = flag(None, "tokens per reply (default: tiny 100, hub models 400/500)", lo=1)
    format_penalty: float = flag(-0.1, "reward of a turn without a valid answer")
    think: bool | None = flag(None, "<think>...</think> before <answer> (paper: on)")
    context_turns: int | None = flag(None, "history: 0 = all turns (paper), K = the last K", lo=0)
    gamma: float = flag(1.0, "GAE discount (PPO)", lo=0, hi=1)
    lam: float = flag(1.0, "GAE lambda (PPO)", lo=0, hi=1)
    grpo_std_norm: bool = flag(True, "GRPO divides by the group std (off: Dr.GRPO)")
    mini_batch: int = flag(32, "training sequences per optimizer step", lo=1)
    ppo_epochs: int = flag(1, "passes over each rollout batch (the paper's runs: 1)", lo=1)
    online_k: int = flag(1, "RAGEN's Online-k (Fig. 7): k x P prompts (paper: 1)", lo=1)
    group_noise: str = flag("shared", "a group's luck: shared (RAGEN's) or not", choices=NOISE)
    response_mask: bool = flag(True, "train sampled tokens only (off: all, as the paper's runs did)")
    loss_agg: str = flag("token-mean", "seq-mean-token-mean: the paper's 1/|tau| form", choices=AGG_MODES)
    temperature: float = flag(1.0, "rollout sampling temperature", gt=0)
    lr: float | None = flag(None, "policy learning rate (default: tiny 1e-4, hub models 1e-6)", gt=0)
    critic_lr: float | None = flag(None, "critic learning rate (default: tiny 1e-3, hub models 1e-5)", gt=0)
    steps: int | None = flag(None, "training iterations (default: tiny 30, hub models 200)", lo=1)
    eval_every: int = flag(10, "evaluate every K iterations (0: only at the end)", lo=0)
    eval_prompts: int | None = flag(None, "eval prompts (default: tiny 128, hub models 256)", lo=1, hi=256)
    eval_temperature: float = flag(0.5, "eval sampling temperature (paper: 0.5)", lo=0)
    # ---- beyond the paper (opt-in, extras/; a run names those it uses in its first line)
    filter_strategy: str = flag("top_k", "RAGEN's rules", choices=["top_k", "top_k_abs", "top_p", "min_p"],
                                beyond=True)
    filter_metric: str = flag("reward_std", "what groups are ranked by", beyond=True, choices=METRICS)
    filter_include_zero: bool = flag(True, "rank zero-score groups too (RAGEN-2: off)", beyond=True)
    filter_top_p_mode: str = flag("linear", "top_p's mode", choices=["linear", "softmax"], beyond=True)
    filter_eps: float = flag(0.01, "top_p linear: RAGEN's selection_eps", lo=0, beyond=True)
    filter_empty_stop: int = flag(0, "stop after K iterations with no group kept", lo=0, beyond=True)
    turn_rewards: bool = flag(False, "PPO: each turn's reward on its last token (RAGEN)", beyond=True)
    bi_level_gae: bool = flag(False, "PPO: turn-level, then token-level GAE (RAGEN)", beyond=True)
    high_level_gamma: float = flag(0.95, "--bi-level-gae's turn-level discount", lo=0, hi=1, beyond=True)
    dual_clip: float = flag(0.0, "verl's dual clip C > 1 (RAGEN's runs: 3; 0: off)", lo=0, beyond=True)
    collapse_every: int = flag(0, "RAGEN-2's template-collapse metrics every K iterations", lo=0, beyond=True)
    collapse_samples: int = flag(64, "first turns scored per collapse measurement", lo=2, beyond=True)
    hindsight_imitation: int = flag(0, "Sokoban: K passes of GCSL after each update", lo=0, beyond=True)
    imitation_demos: str = flag("hindsight", "its demos (or each room's best)", choices=["hindsight", "best"],
                                beyond=True)
    imitation_lr: float | None = flag(None, "its learning rate (default: tiny 2.5e-4, hub models 5e-4)", gt=0)
    gigpo_weight: float = flag(1.0, "--algo gigpo: the step-level advantage's weight", lo=0, beyond=True)
    gigpo_gamma: float = flag(0.95, "--algo gigpo: the step-level discount", gt=0, hi=1, beyond=True)
    gigpo_mode: str = flag("mean_norm", "--algo gigpo: the step groups' normalisation", beyond=True,
                           choices=["mean_norm", "mean_std_norm"])
    # ---- the run, the model, memory
    seed: int = flag(0, "seed of everything", lo=0, hi=cli.SEED_MAX)
    out: str | None = flag(None, "run folder (default: runs/ENV-ALGO-sSEED, preset, digest)")
    resume: str | None = flag(None, "continue the run in this folder from its last checkpoint")
    overwrite: bool = flag(False, "replace the run in --out (only the files a run writes)")
    model: str = flag("tiny", "tiny (the shipped prior), a hub id, a folder, a run or a .gguf file")
    device: str = flag("auto", "auto (CUDA if present), cpu, cuda or cuda:N")
    threads: int = flag(1, "CPU threads", lo=1)
    micro_batch: int | None = flag(None, "sequences per forward (default: tiny 16, hub models 4)", lo=1)
    fused: bool = flag(True, "chunked log-probs, never [B, T, V] logits")
    save_every: int = flag(10, "checkpoint every K iterations (0: only final/)", lo=0)
    dump_trajectories: int = flag(3, "trajectories written as text at each eval", lo=0)
    stop_on_collapse: bool = flag(False, "end the run when the Echo Trap monitor fires")
    lora_rank: int = flag(0, "LoRA adapters of this rank (0: every weight, the paper)", lo=0)
    lora_alpha: float = flag(32.0, "LoRA alpha", gt=0)
    grad_checkpoint: bool = flag(False, "recompute activations in backward (less memory)")
    memory_cap: float | None = flag(None, "CUDA: cap the GPU memory at this many GiB", gt=0)
    webshop_data: str | None = flag(None, "folder with the original WebShop files")
    groups: int = field(default=0, metadata={"derived": True})  # prompt groups rolled out: P x online_k


def derive(cfg: Config, explicit: set[str] = frozenset()) -> Config:
    """Per-model defaults, the default run folder (two commands never share one), one-line errors."""
    kind = model_kind(cfg.model)
    cli.fill_defaults(cfg, {**PAPER, **MODEL_DEFAULTS[kind], "kl_in_reward": cfg.preset == "starpo" and
                            cfg.algo == "ppo", "max_new_tokens": default_reply_tokens(kind, cfg.env)})
    rules = [(not cfg.kl_in_reward or cfg.algo == "ppo", "--kl-in-reward: PPO only (GRPO: in the loss)"),
             (cfg.filter <= 1 or cfg.filter_strategy == "top_k_abs", f"--filter {cfg.filter}: must be <= 1 "
              f"with --filter-strategy {cfg.filter_strategy} (a share; top_k_abs takes a number of groups)"),
             (cfg.micro_batch <= cfg.mini_batch, f"--micro-batch {cfg.micro_batch}: larger than --mini-batch "
                                                 f"{cfg.mini_batch} (a micro-batch is part of a mini-batch)"),
             (not cfg.webshop_data or cfg.env == "webshop", f"--webshop-data {cfg.webshop_data}: only for "
                                                            f"--env webshop (this run: --env {cfg.env})")]
    if cli.opt_ins(cfg) or cfg.algo == "gigpo":
        from extras.options import rules as beyond_rules
        rules += beyond_rules(cfg)
    cli.check(cli.bounds(cfg) + rules)
    cfg.groups = cfg.prompts * cfg.online_k
    base = f"runs/{cfg.env}-{cfg.algo}-s{cfg.seed}"
    cfg.out = cli.default_out(cfg, explicit - {"env", "algo", "seed"}, base, ("preset",)) if cfg.out is None \
        else cfg.out
    return cfg


def seed_of(cfg: Config, it: int, stream: int | None = None) -> int:
    """Iteration `it`'s seed (stream k: the update's k-th pass; 77: the imitation): a resumed run needs no
    saved generator state."""
    return cfg.seed * 1_000_003 + (it if stream is None else it * 101 + stream)


# ---- the loop's steps

def iteration_rollouts(cfg: Config, it: int, policy, tok, rcfg: RolloutConfig, env_kw: dict, device) -> list:
    """Iteration `it`'s rollouts, in groups sharing a room and its luck (torchrun: from every rank)."""
    gen = torch.Generator(device=device).manual_seed(seed_of(cfg, it) + (dist.rank() << 40))
    seeds = train_seeds(np.random.default_rng([cfg.seed, it]), cfg.groups)
    mine, n = dist.my_range(cfg.groups), cfg.rollouts
    samples = [k if cfg.group_noise == "independent" else 0 for _ in mine for k in range(n)]
    policy.eval()
    trajs = rollout(cfg.env, [seeds[g] for g in mine for _ in range(n)], [g for g in mine for _ in range(n)],
                    rcfg, tokenizer=tok, model=policy, generator=gen, env_overrides=env_kw, samples=samples)
    return dist.all_gather_objects(trajs)


def filter_groups(cfg: Config, trajs: list):
    """StarPO-S's filter (section 4.2): whole groups in or out. -> (kept, why the update is skipped, metrics):
    an empty batch, or GRPO's without a reward spread, is logged and skipped, not a silent no-op."""
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
    kept = [t for t in trajs if keep[t.group_id]]
    zero = fs["all_zero_std"] and cfg.algo != "ppo"
    if zero and cfg.algo == "gigpo":  # beyond the paper: turns from one state may still differ
        from extras.gigpo import has_signal
        zero = not has_signal(kept, cfg)
    empty = fs["empty_selection"]
    m.update({"train/skipped_zero_std": float(zero), "train/skipped_empty_filter": float(empty)})
    skip = "the filter kept no group" if empty else "no group has a reward spread" if zero else None
    return kept, skip, m


@torch.no_grad()
def prepare_batch(kept, cfg: Config, policy, ref, critic, pad_id: int, device, amp, on_eval: bool):
    """The update's inputs (section 2.2, Appendix A): rows, advantages, the log-probs and values a loss needs.
    -> (Batch, metrics). Under torchrun each rank runs its rows; every rank ends with all of them."""
    rows = [(s, t) for t in kept for s in t.segments]  # a row per segment
    ids, attn, mask = (x.to(device) for x in pad_segments(
        [Segment(s.input_ids, trained_mask(s, cfg.response_mask)) for s, _ in rows], pad_id))  # [B, T] each
    pre = shared_prefix_len([s.input_ids for s, _ in rows])  # the prompt header, run once

    def logp(model, base_only=False):  # base_only: a LoRA policy's frozen base, its KL reference
        def fn(i, a):
            with adapters_off(model) if base_only else visiting(model, device):
                return token_logprobs(model, i, a, cfg.temperature, cfg.fused, prefix_len=pre)[0].float()
        return fn
    # one optimizer step on fresh rollouts has ratio 1 (no old_logp pass); without a KL term the reference
    # only feeds train/kl_to_init on eval iterations
    one_step = len(ids) <= cfg.mini_batch and cfg.ppo_epochs == 1 and not cfg.kl_in_reward
    run = lambda fn: dist.map_rows(fn, ids, attn, cfg.micro_batch)  # noqa: E731
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        old_logp = None if one_step else run(logp(policy))                                        # [B, T]
        ref_logp = run(logp(policy, True) if ref is None else logp(ref)) if cfg.kl_coef or on_eval else None
        values = run(lambda i, a: critic(i, a).float()) if critic is not None else None           # [B, T]
    metrics, returns = {}, None
    if cfg.algo != "ppo":  # GRPO: each trajectory's group-normalised reward on its sampled tokens
        scores = grpo_advantages(torch.tensor([t.reward for t in kept]), [t.group_id for t in kept],
                                 norm_by_std=cfg.grpo_std_norm).tolist()
        row_adv = torch.tensor([a for t, a in zip(kept, scores) for _ in t.segments])  # [B]
        adv = broadcast_to_tokens(row_adv.to(device), mask)  # [B, T]
        if cfg.algo == "gigpo":  # beyond the paper (extras/gigpo.py)
            from extras.gigpo import gigpo_token_advantages
            adv, metrics = gigpo_token_advantages(kept, rows, mask, cfg)
    else:  # PPO: the reward on each row's last sampled token, GAE with the critic
        rewards = reward_on_last(torch.tensor([t.reward for _, t in rows]).to(device), mask)
        ends = None
        if cfg.turn_rewards or cfg.bi_level_gae:  # beyond the paper
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
                 ref_logp=ref_logp, returns=returns, old_values=values, prefix_len=pre,
                 rollout_logp=pad_logps([s for s, _ in rows], ids.shape[1]).to(device)), metrics


def finite(policy) -> bool:  # one host sync, after a phase that stepped an optimizer
    return bool(torch.stack([torch.isfinite(p).all() for p in policy.parameters()]).all())


def evaluates(cfg: Config, it: int) -> bool:  # every eval_every iterations, and the last one
    return bool(cfg.eval_every and (it + 1) % cfg.eval_every == 0) or it + 1 == cfg.steps


# ---- main

def setup(argv):
    """Every input checked before anything is written, then the run started (engine/run.py)."""
    try:
        cfg, explicit = cli.parse(Config, argv, description=__doc__.split("\n")[0], presets=PRESETS)
        resumable = {"steps", "device", "threads", "memory_cap"}  # the flags a resumed run may change
        cfg = derive(resume_config(Config, cfg, explicit, resumable, dropped=("groups_kept", "hindsight"))
                     if cfg.resume else inherit_rendering(cfg, explicit, ROLLOUT_KEYS), explicit)
        out = Path(cfg.out) if cfg.resume else cli.run_folder(cfg.out, "--out", cfg.overwrite, resumable=True)
        return (cfg, out, *start_run(cfg, out, describe))
    except ValueError as e:
        cli.fail(str(e))


def main(argv=None):
    cfg, out, device, policy, tok, critic, ref, env_kw, start, opts, monitor, metrics_path = setup(argv)
    amp, ucfg = autocast_dtype(device), UpdateConfig.of(cfg)
    train_rcfg, eval_rcfg = (RolloutConfig.of(cfg, t) for t in (cfg.temperature, cfg.eval_temperature))
    # DDP (torchrun) wraps TokenLogprobs, what update() calls, not the HF model
    train_policy, train_critic = dist.ddp(TokenLogprobs(policy), device), dist.ddp(critic, device)
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
            m.update({f"rollout/{'reward_mean' if k == 'reward' else k}": v for k, v in s.items()
                      if k not in ("success_lo", "success_hi", "episodes")})
            m.update({"rollout/reward_std": torch.tensor([t.reward for t in trajs]).std().item(),
                      "time/rollout": time.time() - t0})
            if cfg.collapse_every and it % cfg.collapse_every == 0 and dist.is_main():  # RAGEN-2
                from extras.collapse import measure_collapse
                m.update(measure_collapse(policy, tok, trajs, cfg.collapse_samples, seed_of(cfg, it), amp,
                                          cfg.temperature))
            # 2. StarPO-S's filter
            kept, skip, fm = filter_groups(cfg, trajs)
            m.update(fm)
            empty_run = empty_run + 1 if fm["train/skipped_empty_filter"] else 0
            if skip and dist.is_main():
                tqdm.write(f"[iter {it + 1}] {skip}: update skipped (logged)")
            if not skip:
                # 3. the batch: advantages, log-probs (no grad)
                t1 = time.time()
                batch, pm = prepare_batch(kept, cfg, policy, ref, critic, tok.pad_token_id, device, amp,
                                          on_eval=evaluates(cfg, it))
                m.update({**pm, "time/prep": time.time() - t1})
                # 4. update: ppo_epochs passes, the same mini-batches on every rank
                t2 = time.time()
                for model in (policy, critic) if critic is not None else (policy,):
                    model.train()
                passes = [update(train_policy, opts["opt"], batch, ucfg, train_critic, opts["critic_opt"],
                                 torch.Generator().manual_seed(seed_of(cfg, it, k)), amp,
                                 (dist.rank(), dist.world_size())) for k in range(cfg.ppo_epochs)]
                counts = ("train/optimizer_steps", "train/skipped_nonfinite")  # summed; the others averaged
                m.update({k: (sum if k in counts else mean)([p[k] for p in passes]) for k in passes[0]})
                m.update({"train/rows": len(batch), "time/update": time.time() - t2})
                diverged = None if finite(policy) else "the update made the policy's weights non-finite"
            # 4b. beyond the paper: hindsight imitation (extras/hindsight.py)
            if cfg.hindsight_imitation and not diverged:
                from extras.hindsight import imitation_step
                gen = torch.Generator().manual_seed(seed_of(cfg, it, 77))
                m.update(imitation_step(cfg, trajs, train_policy, opts["imit_opt"], ucfg, tok, train_rcfg,
                                        env_kw, gen, amp))
                diverged = None if finite(policy) else "the imitation made the policy's weights non-finite"
            # 5. the Echo Trap monitor, eval, log, checkpoint: rank 0
            if dist.is_main():
                for w in watch(monitor, m):
                    tqdm.write(f"[iter {it + 1}] ECHO TRAP WARNING: {w}")
                    stop = stop or (w if cfg.stop_on_collapse else None)
                if cfg.filter_empty_stop and empty_run >= cfg.filter_empty_stop:
                    stop = f"the filter kept no group {empty_run} iterations in a row (--filter-empty-stop)"
                last = it + 1 == cfg.steps or stop is not None
                if (evaluates(cfg, it) or last) and not diverged:
                    try:
                        dumps = out / f"trajectories-{it + 1:06d}.txt"
                        m.update(eval_metrics(cfg.env, eval_rcfg, policy, tok, cfg.eval_prompts, cfg.seed,
                                              env_kw, dumps, cfg.dump_trajectories))
                    except FloatingPointError as e:  # this iteration's line is still written below
                        diverged = str(e)
                m.update({**memory_metrics(device), "time/iteration": time.time() - t0})
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(m) + "\n")
                if cfg.save_every and ((it + 1) % cfg.save_every == 0 or last) and not diverged:
                    states = {k: o.state_dict() for k, o in opts.items() if o is not None}
                    save_checkpoint(out, it + 1, tok, {"policy": policy, "critic": critic},
                                    {**states, "monitor": asdict(monitor)}, config=asdict(cfg))
                    saved_at = it + 1
                tqdm.write(iteration_line(m))
            if diverged:
                raise FloatingPointError(diverged)
            if stop := dist.broadcast_object(stop):  # rank 0 decides
                if dist.is_main():
                    tqdm.write(f"stopping: {stop}")
                break
    except FloatingPointError as e:  # a diverged policy can no longer sample
        ck = f"{out}/ckpt-{saved_at:06d}" if saved_at else "none"
        cli.fail(f"iteration {it + 1}: {e} (--lr {cfg.lr} is too high?); the metrics so far are in "
                 f"{metrics_path}, the last checkpoint: {ck}", code=1)
    except KeyboardInterrupt:
        bar.close()
        where = f"iteration {saved_at}" if saved_at else "none yet"
        raise KeyboardInterrupt(f"at iteration {it + 1} (last checkpoint: {where}); continue with: python "
                                f"train.py --resume {out}") from None
    bar.close()
    del train_policy, train_critic  # they hold the process group, which finish_run() frees
    return finish_run(cfg, out, policy, tok, critic)


if __name__ == "__main__":
    cli.run(main)
