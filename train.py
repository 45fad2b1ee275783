"""StarPO / StarPO-S training (paper sections 2-4): rollouts -> filter -> update.

    python train.py --env sokoban --algo grpo --filter 0.25  # StarPO-S, the paper's
    python train.py --preset starpo --env bandit  # StarPO: no filter, KL, clip 0.2/0.2
    python train.py --algo ppo --model Qwen/Qwen2.5-0.5B-Instruct  # the paper's run, a GPU

`main` reads top to bottom: the config, the setup (device, policy, critic, KL reference,
optimizers, monitor), then the loop. One iteration: P prompts x N rollouts -> keep the
groups whose rewards disagree most (section 4.2) -> advantages (GRPO: group-normalised;
PPO: GAE with a critic) -> mini-batch updates -> the Echo Trap monitor, a JSONL line,
eval, checkpoint. Each draw of iteration i derives from (--seed, i): --resume reproduces
the uninterrupted run. Options beyond the paper (extras/) plug into the loop's named
points (`extension_points`). Next: sft_baseline.py.
"""
from __future__ import annotations

import copy
import functools
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from advantages import ESTIMATORS, estimator, has_signal
from engine import cli
from engine import distributed as dist
from engine.checkpoint import append_metrics, open_run, read_metrics, restore_models, restore_optimizers
from engine.checkpoint import resume_config, resume_point, save_checkpoint
from engine.logprobs import TokenLogprobs
from engine.lora import apply_levers
from engine.models import DTYPES, all_finite, autocast_dtype, check_budgets, choose_dtype
from engine.models import default_reply_tokens, load_critic, load_policy, memory_metrics
from engine.models import model_kind, pick_device, setup_device
from engine.report import iteration_line, run_line
from engine.run import finish_run, inherit_rendering, run_complete, stopped
from envs import ENVS, data_rules
from eval import eval_metrics, rollout_metrics
from extras.options import Options, plug
from extras.options import describe as describe_options, rules as option_rules
from filter import filter_groups, select_groups
from monitor import EchoMonitor, watch
from rollout import ROLLOUT_KEYS, RolloutConfig, group_rollouts
from starpo import AGG_MODES, Critic, UpdateConfig, build_batch, merge_passes, token_logprobs, update

# the paper's two recipes (section 4.2, App. C.2); StarPO's KL is RAGEN's k1
PRESETS = {
    "starpo": dict(filter=1.0, kl_coef=0.001, kl_kind="k1", clip_low=0.2, clip_high=0.2),
    "starpo-s": dict(filter=0.25, kl_coef=0.0, clip_low=0.2, clip_high=0.28)}
# the fields left at None, per model size: hub models the paper's (App. C.2), tiny a CPU's. lora_lr: the
# policy's rate with --lora-rank, ~10x full fine-tuning's (Schulman et al. 2025, "LoRA Without Regret")
MODEL_DEFAULTS = {
    "tiny": dict(lr=1e-4, lora_lr=1e-4, critic_lr=1e-3, steps=30, eval_prompts=128, micro_batch=16,
                 imitation_lr=2.5e-4, threads=1),
    "hf": dict(lr=1e-6, lora_lr=1e-5, critic_lr=1e-5, steps=200, eval_prompts=256, micro_batch=4,
               imitation_lr=5e-4, threads=os.cpu_count() or 1)}
KL, NOISE = ["k1", "k3"], ["shared", "independent"]
flag = cli.flag


# options beyond the paper, opt-in: Options' fields (extras/options.py), after these in --help
@dataclass
class Config(Options):
    # ---- the paper's method (section 4.2, Appendix C.2)
    env: str = flag("sokoban", "the environment (section 3.1)", choices=ENVS)
    algo: str = flag("grpo", "advantages: grpo (group-normalised), ppo (critic + GAE)", choices=ESTIMATORS)
    preset: str | None = flag(None, "the paper's recipes (typed flags win)", choices=PRESETS)
    filter: float = flag(0.25, "fraction of prompt groups kept by in-group reward std (1 = all)", gt=0)
    filter_smallest: bool = flag(False, "keep the LOWEST-std groups (the paper's ablation)")
    kl_coef: float = flag(0.0, "KL-to-initial-policy coefficient (StarPO: 0.001)", lo=0)
    kl_kind: str = flag("k3", "KL estimator: k1 (RAGEN's `kl`, the paper's runs), k3", choices=KL)
    kl_in_reward: bool | None = flag(None, "PPO: the KL in the rewards (default: with --preset starpo)")
    clip_low: float = flag(0.2, "PPO clip eps_low", lo=0, lt=1)
    clip_high: float = flag(0.28, "PPO clip eps_high (Clip-Higher; StarPO: 0.2)", lo=0)
    entropy_coef: float = flag(0.001, "entropy bonus coefficient", lo=0)
    value_clip: float = flag(0.5, "PPO: the value loss's clip around the rollout's values", gt=0)
    grad_clip: float = flag(1.0, "gradient norm clip, policy and critic", gt=0)
    weight_decay: float = flag(0.01, "AdamW weight decay, policy and critic (verl's)", lo=0)
    prompts: int = flag(8, "P: prompts (initial states) per iteration", lo=1)
    rollouts: int = flag(16, "N: rollouts per prompt, a group", lo=2)
    max_turns: int = flag(5, "turns per episode", lo=1)
    max_actions_per_turn: int = flag(5, "actions per turn", lo=1)
    max_actions: int = flag(10, "actions per episode", lo=1)
    max_new_tokens: int | None = flag(None, "tokens per reply (default: tiny 100, hub models 400/500)", lo=1)
    format_penalty: float = flag(-0.1, "reward of a turn without a valid answer")
    think: bool = flag(True, "<think>...</think> before <answer> (--no-think: answer only)")
    context_turns: int = flag(0, "history: 0 = the whole conversation, K = the last K turns", lo=0)
    gamma: float = flag(1.0, "GAE discount (PPO)", lo=0, hi=1)
    lam: float = flag(1.0, "GAE lambda (PPO)", lo=0, hi=1)
    grpo_std_norm: bool = flag(True, "GRPO divides by the group std (off: Dr.GRPO)")
    mini_batch: int = flag(32, "training sequences per optimizer step", lo=1)
    ppo_epochs: int = flag(1, "passes over each rollout batch (the paper's runs: 1)", lo=1)
    online_k: int = flag(1, "RAGEN's Online-k (Fig. 7): k x P prompts, each used once", lo=1)
    group_noise: str = flag("shared", "a group's luck: shared (RAGEN's) or independent", choices=NOISE)
    response_mask: bool = flag(True, "train sampled tokens only (off: all, as the paper's runs did)")
    loss_agg: str = flag("token-mean", "seq-mean-token-mean: the paper's 1/|tau| form", choices=AGG_MODES)
    temperature: float = flag(1.0, "rollout sampling temperature", gt=0)
    lr: float | None = flag(None, "policy learning rate (default: tiny 1e-4, hub 1e-6)", gt=0)
    critic_lr: float | None = flag(None, "critic learning rate (default: tiny 1e-3, hub 1e-5)", gt=0)
    steps: int | None = flag(None, "training iterations (default: tiny 30, hub models 200)", lo=1)
    eval_every: int = flag(10, "evaluate the start (iteration 0), every K and the last (0: the last)", lo=0)
    eval_prompts: int | None = flag(None, "eval prompts (default: tiny 128, hub 256)", lo=1, hi=256)
    eval_temperature: float = flag(0.5, "eval sampling temperature (paper: 0.5)", lo=0)
    # ---- the run, the model, memory
    seed: int = flag(0, "seed of everything (rooms, sampling, batch order)", lo=0, hi=cli.SEED_MAX)
    out: str | None = flag(None, "run folder (default: runs/ENV-ALGO-sSEED, preset, digest)")
    resume: str | None = flag(None, "continue the run in this folder from its last checkpoint")
    overwrite: bool = flag(False, "replace the run in --out (only the files a run writes)")
    model: str = flag("tiny", "tiny (the shipped prior), a hub id, a folder, a run or a .gguf file")
    device: str = flag("auto", "auto (CUDA if present), cpu, cuda or cuda:N")
    threads: int | None = flag(None, "CPU threads (default: tiny 1, the fastest on 2 cores; hub all)", lo=1)
    dtype: str = flag("auto", "compute dtype: auto (bf16 on CUDA, and on CPUs with native bf16 for hub "
                      "models), fp32, bf16", choices=DTYPES)
    micro_batch: int | None = flag(None, "sequences per forward (default: tiny 16, hub 4)", lo=1)
    fused: bool = flag(True, "chunked log-probs, never the [B, T, V] logits")
    save_every: int = flag(10, "checkpoint every K iterations (0: only final/)", lo=0)
    dump_trajectories: int = flag(3, "trajectories written as text at each eval", lo=0)
    stop_on_collapse: bool = flag(False, "end the run when the Echo Trap monitor fires")
    lora_rank: int = flag(0, "LoRA adapters of this rank (0: every weight, the paper)", lo=0)
    lora_alpha: float = flag(32.0, "LoRA alpha (the update is scaled by alpha / rank)", gt=0)
    grad_checkpoint: bool = flag(False, "recompute activations in backward (less memory)")
    memory_cap: float | None = flag(None, "CUDA: cap the GPU memory at this many GiB", gt=0)
    webshop_data: str | None = flag(None, "folder with the original WebShop files")
    # derived once the flags are read: the prompt groups rolled out, P x online_k
    groups: int = field(default=0, metadata={"derived": True})


RESUMABLE = {"steps", "device", "threads", "memory_cap"}  # what --resume may change


def derive(cfg: Config, explicit: set[str] = frozenset()) -> Config:
    """The per-model defaults, the run folder (two commands never share one), the
    rules between flags: one-line errors."""
    kind = model_kind(cfg.model)
    defaults = dict(MODEL_DEFAULTS[kind])
    lora_lr = defaults.pop("lora_lr")
    if cfg.lora_rank:
        defaults["lr"] = lora_lr
    defaults["max_new_tokens"] = default_reply_tokens(kind, cfg.env)
    cli.fill_defaults(cfg, defaults)
    if cfg.kl_in_reward is None:  # StarPO with PPO as the paper ran it
        cfg.kl_in_reward = cfg.preset == "starpo" and cfg.algo == "ppo"
    if cfg.micro_batch > cfg.mini_batch and "micro_batch" not in explicit:
        cfg.micro_batch = cfg.mini_batch  # a default follows what was typed
    share = cfg.filter <= 1 or cfg.filter_strategy == "top_k_abs"
    rules = [
        (not cfg.kl_in_reward or cfg.algo == "ppo",
         "--kl-in-reward: PPO only (GRPO: in the loss)"),
        (share, f"--filter {cfg.filter}: must be <= 1 with --filter-strategy "
                f"{cfg.filter_strategy} (a share; top_k_abs takes a number of groups)"),
        (cfg.micro_batch <= cfg.mini_batch,
         f"--micro-batch {cfg.micro_batch}: larger than --mini-batch "
         f"{cfg.mini_batch} (a micro-batch is part of a mini-batch)")]
    rules += data_rules(cfg.webshop_data, [cfg.env])
    rules += option_rules(cfg, explicit)  # those of the options beyond the paper
    cli.check(cli.bounds(cfg) + rules)
    cfg.groups = cfg.prompts * cfg.online_k
    if cfg.out is None:
        base = f"runs/{cfg.env}-{cfg.algo}-s{cfg.seed}"
        typed = explicit - {"env", "algo", "seed"}
        cfg.out = cli.default_out(cfg, typed, base, ("preset",))
    return cfg


def configure(argv) -> tuple[Config, Path]:
    """The flags -> (the checked Config, the run folder). A resumed run reads its own
    config; a --model that a run trained lends its prompt rendering. Writes nothing."""
    about = __doc__.split("\n")[0]
    cfg, explicit = cli.parse(Config, argv, description=about, presets=PRESETS)
    if cfg.resume:
        dropped = ("groups_kept", "hindsight")  # keys of removed fields
        cfg = resume_config(Config, cfg, explicit, RESUMABLE, dropped)
        return derive(cfg, explicit), Path(cfg.out)
    cfg = inherit_rendering(cfg, explicit, ROLLOUT_KEYS)
    cfg = derive(cfg, explicit)
    out = cli.run_folder(cfg.out, "--out", cfg.overwrite, resumable=True)
    return cfg, out


def describe(cfg: Config, device) -> str:
    """The run's first line. StarPO-S: the paper's three changes (the filter, no KL,
    Clip-Higher); StarPO: none of them; else, or with an option, "(modified)"."""
    extra, modified = describe_options(cfg)
    modified = modified or cfg.algo not in ("grpo", "ppo")
    changes = [cfg.filter < 1, cfg.kl_coef == 0, cfg.clip_high > cfg.clip_low]
    name = "StarPO-S" if all(changes) else "StarPO"
    if modified or (any(changes) and not all(changes)):
        name += " (modified)"
    return run_line(name, cfg, extra, device)


def seed_of(cfg: Config, it: int, stream: int | None = None) -> int:
    """Iteration `it`'s seed (stream k: the update's k-th pass; 77: the imitation):
    a resumed run needs no saved generator state."""
    if stream is None:
        return cfg.seed * 1_000_003 + it
    return cfg.seed * 1_000_003 + it * 101 + stream


# ---- the extension points: what the loop calls by name

def paper_filter(group_rewards: torch.Tensor, cfg: Config):
    """StarPO-S's filter (section 4.2): the top --filter share by in-group std."""
    return select_groups(group_rewards, cfg.filter, largest=not cfg.filter_smallest)


def extension_points(cfg: Config, run: dict) -> dict:
    """The loop's named points: the filter, the estimator (--algo, from
    advantages.ESTIMATORS), the policy loss (None: starpo.policy_loss), and hooks
    (the paper has none): after the rollout and after the update, `hook(it, trajs,
    metrics) -> a reason to stop, or None`; after the batch is built, `hook(batch,
    metrics)`, which may reweight or mask it. An option beyond the paper plugs in here
    (extras/options.py); `run` holds what a hook may use (policy, optimizers, ...)."""
    points = {"filter": paper_filter, "estimator": estimator(cfg.algo),
              "policy_loss": None, "after_rollout": [], "after_batch": [],
              "after_update": []}
    plug(cfg, points, run)  # each option the run uses
    return points


# ---- the loop's steps

def evaluates(cfg: Config, it: int) -> bool:  # every eval_every, and the last
    if it + 1 == cfg.steps:
        return True
    return bool(cfg.eval_every) and (it + 1) % cfg.eval_every == 0


# ---- main

def main(argv=None):
    # ---- 1. the config: every input checked before anything is written
    with cli.one_line_errors():
        cfg, out = configure(argv)
        # 0, or a resumed run's latest checkpoint
        start, state, ck = resume_point(cfg, out)
        if run_complete(out, start, cfg.steps, ck):  # nothing to do, nothing written
            return out

        # ---- 2. the setup: device, policy, critic, reference, optimizers
        device = dist.init(pick_device(cfg.device))  # torchrun: a GPU each
        dist.check_groups(cfg.prompts, cfg.online_k)
        dtype = choose_dtype(cfg.dtype, device, model_kind(cfg.model))
        setup_device(device, cfg.threads, cfg.memory_cap, dtype)
        amp = autocast_dtype(device)  # bf16 autocast or None; fp32 weights
        with dist.main_first():  # rank 0 downloads, the others read
            policy, tok, path = load_policy(cfg.model, device)
        check_budgets(policy, cfg.max_new_tokens, cfg.lora_rank)
        env_kw = {"data_dir": cfg.webshop_data} if cfg.webshop_data else {}
        ENVS[cfg.env](**env_kw)  # a bad env option fails now
        # PPO's critic (Appendix A): the policy's backbone, a value head
        critic = None
        if estimator(cfg.algo).needs_critic:
            critic = Critic(*load_critic(path, device))
        # the KL reference: the initial policy, frozen. Under LoRA, the
        # policy with its adapters off (the base never trains): no copy
        # (verl's ref_in_actor)
        ref = None
        if not cfg.lora_rank:
            ref = copy.deepcopy(policy).eval().requires_grad_(False)
            if not cfg.kl_coef:  # only measured on evals: in CPU memory
                ref.to("cpu")
        backbone = critic.backbone if critic is not None else None
        apply_levers([policy, backbone], cfg.lora_rank, cfg.lora_alpha,
                     cfg.grad_checkpoint, cfg.seed)
        # AdamW (verl's weight decay), on what trains: all, or LoRA's
        trained = [p for p in policy.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(trained, lr=cfg.lr,
                                weight_decay=cfg.weight_decay)
        critic_opt = None
        if critic is not None:
            trained = [p for p in critic.parameters() if p.requires_grad]
            critic_opt = torch.optim.AdamW(trained, lr=cfg.critic_lr,
                                           weight_decay=cfg.weight_decay)
        optimizers = {"opt": opt, "critic_opt": critic_opt}
        monitor = EchoMonitor()  # the Echo Trap's signals (section 4.1)
        if ck is not None:  # a resumed run: its weights
            restore_models(ck, state, policy, critic, cfg.lora_rank > 0,
                           f"--resume {cfg.out}")

        # ---- 3. the extension points, the update's objects
        train_rcfg = RolloutConfig.of(cfg, cfg.temperature)
        eval_rcfg = RolloutConfig.of(cfg, cfg.eval_temperature)
        # DDP (torchrun) wraps what update() calls, not the HF model
        scorer = TokenLogprobs(policy, token_logprobs)
        train_policy = dist.ddp(scorer, device)
        train_critic = dist.ddp(critic, device)
        models = {"policy": policy, "ref": ref, "critic": critic}
        run = dict(policy=policy, train_policy=train_policy, tok=tok,
                   rcfg=train_rcfg, env_kw=env_kw, amp=amp, optimizers=optimizers,
                   seed=functools.partial(seed_of, cfg))
        points = extension_points(cfg, run)
        ucfg = run["ucfg"] = UpdateConfig.of(cfg, points["policy_loss"])
        kept_metrics = []
        if ck is not None:  # its optimizers (an option's too), monitor, log
            restore_optimizers(state, optimizers)
            monitor = EchoMonitor(**state["monitor"])
            if dist.is_main():
                kept_metrics = read_metrics(out / "metrics.jsonl", start)

    # ---- 4. the run folder: the first line, config.json, metrics (rank 0)
    metrics_path = out / "metrics.jsonl"
    if dist.is_main():
        print(describe(cfg, f"{device}, {dtype}"))
        fresh = cfg.overwrite and not cfg.resume
        metrics_path = open_run(out, cli.as_dict(cfg), start, kept_metrics,
                                fresh, ck)

    # ---- 5. the loop, after an eval of the start (iteration 0: verl's val_before_train)
    if start == 0 and cfg.eval_every and dist.is_main():
        m = {"step": 0}
        m.update(eval_metrics(cfg.env, eval_rcfg, policy, tok, cfg.eval_prompts, cfg.seed, env_kw,
                              out / "trajectories-000000.txt", cfg.dump_trajectories))
        append_metrics(metrics_path, m)
        print(iteration_line(m))
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps,
               desc=describe(cfg, "").split(":")[0], dynamic_ncols=True,
               disable=not dist.is_main())
    stop, saved_at, it = None, start, start
    try:
        for it in bar:
            t0 = time.time()
            m = {"step": it + 1}
            diverged = None

            # 1. rollouts: P prompts x N rollouts (x online_k), in groups
            trajs = group_rollouts(cfg, it, seed_of(cfg, it), policy, tok,
                                   train_rcfg, env_kw, device)
            m.update(rollout_metrics(trajs))
            m["time/rollout"] = time.time() - t0
            for hook in points["after_rollout"]:
                stop = hook(it, trajs, m) or stop

            # 2. StarPO-S's filter: whole groups in or out. An empty batch, or
            # one without a signal for the estimator, is logged and skipped,
            # never a silent zero loss
            kept, fm, fs = filter_groups(trajs, cfg.groups, points["filter"], cfg)
            m.update(fm)
            est = points["estimator"]  # whether it learns without a spread
            no_signal = fs["all_zero_std"] and not has_signal(est, kept, cfg)
            m["train/skipped_zero_std"] = float(no_signal)
            m["train/skipped_empty_filter"] = float(fs["empty_selection"])
            skip = "no group has a reward spread" if no_signal else None
            if fs["empty_selection"]:
                skip = "the filter kept no group"
            if skip and dist.is_main():
                tqdm.write(f"[iter {it + 1}] {skip}: update skipped (logged)")

            if not skip:
                # 3. the batch: log-probs and values (no grad), then the
                # estimator's advantages (section 2.2), one row a segment
                t1 = time.time()
                rows = [(s, t) for t in kept for s in t.segments]
                # one optimizer step on fresh rollouts has ratio 1: no
                # old_logp pass (but for a hook that may read it)
                one_step = len(rows) <= cfg.mini_batch and cfg.ppo_epochs == 1
                one_step = one_step and not cfg.kl_in_reward
                one_step = one_step and not points["after_batch"]
                # no KL term: the reference only feeds train/kl_to_init, on evals
                ref_pass = bool(cfg.kl_coef) or evaluates(cfg, it)
                batch = build_batch(rows, models, tok.pad_token_id, cfg, device,
                                    amp, old_logp=not one_step, ref_logp=ref_pass)
                adv, returns, pm = est(kept, rows, batch, cfg)
                batch.advantages, batch.returns = adv, returns
                for hook in points["after_batch"]:
                    hook(batch, pm)
                m.update(pm)
                m["time/prep"] = time.time() - t1

                # 4. update: ppo_epochs passes, the same on every rank
                t2 = time.time()
                policy.train()
                if critic is not None:
                    critic.train()
                passes = []
                for k in range(cfg.ppo_epochs):
                    gen = torch.Generator().manual_seed(seed_of(cfg, it, k))
                    shard = (dist.rank(), dist.world_size())
                    passes.append(update(train_policy, opt, batch, ucfg,
                                         train_critic, critic_opt, gen, amp,
                                         shard))
                m.update(merge_passes(passes))
                m["train/rows"] = len(batch)
                m["time/update"] = time.time() - t2
                if not all_finite(policy):
                    diverged = "the update made the weights non-finite"

            # 4b. the options' hooks after the update (none in the paper)
            if points["after_update"] and not diverged:
                for hook in points["after_update"]:
                    stop = hook(it, trajs, m) or stop
                if not all_finite(policy):
                    diverged = "a hook made the weights non-finite"

            # 5. the Echo Trap monitor, eval, log, checkpoint: rank 0
            if dist.is_main():
                for w in watch(monitor, m):
                    tqdm.write(f"[iter {it + 1}] ECHO TRAP WARNING: {w}")
                    if cfg.stop_on_collapse:
                        stop = stop or w
                last = it + 1 == cfg.steps or stop is not None
                if (evaluates(cfg, it) or last) and not diverged:
                    dumps = out / f"trajectories-{it + 1:06d}.txt"
                    try:
                        m.update(eval_metrics(
                            cfg.env, eval_rcfg, policy, tok, cfg.eval_prompts,
                            cfg.seed, env_kw, dumps, cfg.dump_trajectories))
                    except FloatingPointError as e:  # the line is still written
                        diverged = str(e)
                m.update(memory_metrics(device))
                m["time/iteration"] = time.time() - t0
                append_metrics(metrics_path, m)
                every = cfg.save_every
                saves = every and ((it + 1) % every == 0 or last)
                if saves and not diverged:
                    state = {**optimizers, "monitor": asdict(monitor)}
                    nets = {"policy": policy, "critic": critic}
                    save_checkpoint(out, it + 1, tok, nets, state, cli.as_dict(cfg))
                    saved_at = it + 1
                tqdm.write(iteration_line(m))

            if diverged:
                raise FloatingPointError(diverged)
            stop = dist.broadcast_object(stop)  # rank 0 decides
            if stop:
                if dist.is_main():
                    tqdm.write(f"stopping: {stop}")
                break
    except (FloatingPointError, KeyboardInterrupt) as e:  # a diverged policy, or Ctrl-C
        bar.close()
        stopped(e, it + 1, saved_at, out, f"--lr {cfg.lr}")
    bar.close()
    # these hold the process group, which finish_run() frees
    del train_policy, train_critic, run, points
    return finish_run(cfg, out, policy, tok, critic)


if __name__ == "__main__":
    cli.run(main)
