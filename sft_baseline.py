"""Supervised fine-tuning on expert trajectories (paper Appendix G): the baseline that shows what RL costs.

    python sft_baseline.py --env sokoban  # tiny policy, CPU: full fine-tuning, minutes
    python eval.py --env sokoban --policy runs/sft-sokoban-s0
    python sft_baseline.py --env sokoban --model Qwen/Qwen2.5-0.5B-Instruct  # the paper's, one GPU

The env's expert plays training seeds, rendered as rollouts (loss mask 1 on its replies) -> epochs of
cross-entropy (paper: 1,000 trajectories, 5 epochs, batches of 128, LoRA 64/32; the tiny policy's recipe:
docs/sft.md) -> the test loss each epoch, the lowest kept -> LoRA merged -> a folder eval.py loads.
"""
from __future__ import annotations

import functools
import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine import cli
from engine.checkpoint import append_metrics, open_run, read_metrics, restore_models, resume_config
from engine.checkpoint import resume_point, save_checkpoint, save_final
from engine.logprobs import pad_segments, shared_prefix_len, sorted_micro_batches
from engine.lora import add_lora, merge_lora, trainable_state
from engine.models import DTYPES, autocast_dtype, check_budgets, choose_dtype, default_reply_tokens
from engine.models import default_threads, load_policy, model_kind
from engine.models import pick_device, setup_device, unknown_words
from engine.report import dump, step_line
from envs import ENVS, data_rules, train_seeds
from eval import evaluate, expert_agent
from rollout import RolloutConfig, Segment, prefill, rollout
from starpo import token_logprobs

MODEL_DEFAULTS = {  # fields left at None: hub models the paper's (App. G), tiny what trains on a CPU
    "tiny": dict(train_trajectories=2800, epochs=3, lr=2e-3, adam_beta2=0.95, lora_rank=0, context_turns=1,
                 batch=16, micro_batch=16, short_steps=300),
    "hf": dict(train_trajectories=1000, epochs=5, lr=1e-4, adam_beta2=0.999, lora_rank=64, context_turns=0,
               batch=128, micro_batch=4, short_steps=0),
}
WARMUP_FRACTION = 0.05
flag = cli.flag


@dataclass
class Config:
    # ---- the paper's baseline (Appendix G)
    env: str = flag("sokoban", "environment", choices=ENVS)
    train_trajectories: int | None = flag(None, "expert trajectories to train on (default: tiny 2,800, "
                                          "hub models the paper's 1,000)", lo=1)
    test_trajectories: int = flag(100, "expert trajectories for the test loss (paper: 100)", lo=1)
    expert_actions: int | None = flag(None, "expert moves per turn (default: ceil(max-actions / "
                                      "max-turns))")
    max_turns: int = flag(5, "turns per episode", lo=1)
    max_actions_per_turn: int = flag(5, "actions per turn", lo=1)
    max_actions: int = flag(10, "actions per episode", lo=1)
    max_new_tokens: int | None = flag(None, "token budget per reply at eval (default: tiny 100; hub "
                                      "models RAGEN's 400, 500 on bandit)", lo=1)
    format_penalty: float = flag(-0.1, "reward of a turn without a valid answer (eval)")
    think: bool = flag(True, "<think>...</think> before <answer> (--no-think: answer only)")
    context_turns: int | None = flag(None, "history window: 0 = the whole conversation, K = the last K "
                                     "turns (default: tiny 1, hub models 0)", lo=0)
    epochs: int | None = flag(None, "passes over the training data (default: tiny 3, hub models 5)", lo=1)
    batch: int | None = flag(None, "training sequences per optimizer step (default: tiny 16, hub "
                             "models 128)", lo=1)
    lr: float | None = flag(None, "peak learning rate (default: tiny 2e-3, hub models 1e-4)", gt=0)
    adam_beta2: float | None = flag(None, "AdamW's beta2, the decay of its squared-gradient average "
                                    "(default: tiny 0.95, hub models torch's 0.999)", lo=0, lt=1)
    weight_decay: float = flag(0.01, "AdamW weight decay (verl's)", lo=0)
    grad_clip: float = flag(1.0, "gradient norm clip", gt=0)
    short_steps: int | None = flag(None, "a curriculum, short examples first: this many steps on the "
                                   "expert's states shown alone, each answered by its reply, before the "
                                   "epochs (default: tiny 300, hub models 0)", lo=0)
    short_batch: int = flag(32, "sequences per step of the short examples", lo=1)
    lora_rank: int | None = flag(None, "LoRA rank r, 0 = full fine-tuning (default: tiny 0, hub models "
                                 "64)", lo=0)
    lora_alpha: float = flag(32.0, "LoRA alpha (the update is scaled by alpha / r)", gt=0)
    eval_every: int = flag(0, "also evaluate every this many epochs (0: only the kept policy, at the "
                           "end)", lo=0)
    eval_prompts: int = flag(256, "eval prompts, <= 256", lo=1, hi=256)
    eval_temperature: float = flag(0.5, "eval sampling temperature (paper: 0.5)", lo=0)
    # ---- the run, the model
    seed: int = flag(0, "seed of everything (data seeds, batch order, eval sampling)", lo=0, hi=cli.SEED_MAX)
    out: str | None = flag(None, "run folder (default: runs/sft-ENV-sSEED); never overwritten unless "
                           "--overwrite")
    resume: str | None = flag(None, "continue the run in this folder from its last checkpoint (only "
                              "--device and --threads may change)")
    overwrite: bool = flag(False, "replace the run already in --out (only the files a run writes)")
    save_every: int = flag(100, "checkpoint every this many optimizer steps (0: none)", lo=0)
    dump_trajectories: int = flag(3, "trajectories written as text at each eval", lo=0)
    model: str = flag("tiny", "tiny (the shipped prior, offline), a hub id such as "
                      "Qwen/Qwen2.5-0.5B-Instruct, a folder or a .gguf file")
    device: str = flag("auto", "auto (CUDA if present), cpu, cuda or cuda:N")
    threads: int | None = flag(None, "CPU threads (default: tiny 1, the fastest on 2 cores; hub models "
                               "all)", lo=1)
    dtype: str = flag("auto", "compute dtype: auto (bf16 on CUDA, and on CPUs with native bf16 for hub "
                      "models), fp32, bf16", choices=DTYPES)
    micro_batch: int | None = flag(None, "training sequences per forward/backward, gradient "
                                   "accumulation (default: tiny 16, hub models 4)", lo=1)
    fused: bool = flag(True, "the chunked log-prob path that never builds [B, T, V] logits")
    webshop_data: str | None = flag(None, "folder with the original WebShop files (default: the "
                                    "shipped catalogue)")
    # derived once the data is built: the optimizer steps
    steps: int = field(default=0, metadata={"derived": True})


RESUMABLE = {"device", "threads"}  # the flags a resumed run may change


def derive(cfg: Config) -> Config:
    """The per-model defaults, the run folder, one-line errors."""
    kind = model_kind(cfg.model)
    cli.fill_defaults(cfg, MODEL_DEFAULTS[kind])
    budget = default_reply_tokens(kind, cfg.env)
    cli.fill_defaults(cfg, {"max_new_tokens": budget, "threads": default_threads(kind)})
    if cfg.expert_actions is None:  # the fewest moves per turn that use the whole budget
        turns = max(1, cfg.max_turns)
        cfg.expert_actions = min(cfg.max_actions_per_turn, -(-cfg.max_actions // turns))
    cli.check(cli.bounds(cfg) + [
        (1 <= cfg.expert_actions <= cfg.max_actions_per_turn,
         f"--expert-actions {cfg.expert_actions}: must be in 1..{cfg.max_actions_per_turn} "
         f"(--max-actions-per-turn)")] + data_rules(cfg.webshop_data, [cfg.env]))
    if cfg.out is None:
        cfg.out = f"runs/sft-{cfg.env}-s{cfg.seed}"
    return cfg


def configure(argv) -> tuple[Config, Path]:
    """The flags -> (the checked Config, the run folder); a resumed run reads its own config. Nothing is
    written here."""
    cfg, explicit = cli.parse(Config, argv, description=__doc__.split("\n")[0])
    if cfg.resume:
        cfg = resume_config(Config, cfg, explicit, RESUMABLE)
        return cfg, Path(cfg.out)
    cfg = derive(cfg)
    return cfg, cli.run_folder(cfg.out, "--out", cfg.overwrite, resumable=True)


# ---- the data

def data_seeds(seed: int, n_train: int, n_test: int) -> tuple[list[int], list[int]]:
    """Distinct training seeds (never an eval seed) -> (train, test)."""
    seeds = train_seeds(np.random.default_rng([seed, 0]), n_train + n_test)
    return seeds[:n_train], seeds[n_train:]


def expert_trajectories(env: str, seeds: list[int], rcfg, tok, actions_per_turn: int,
                        env_overrides: dict | None = None):
    """The expert's episodes, rendered as rollouts."""
    return rollout(env, seeds, list(range(len(seeds))), rcfg, tokenizer=tok,
                   agent=expert_agent(actions_per_turn), env_overrides=env_overrides)


def short_examples(trajs, tok, rcfg) -> list:
    """The curriculum: each state the expert met, alone, answered by its reply."""
    tag, out = prefill(rcfg), []
    for t in trajs:
        for turn in t.turns:
            prompt = tok.apply_chat_template([{"role": "user", "content": f"State:\n{turn.obs}\n"}],
                                             tokenize=False, add_generation_prompt=True) + tag
            ids = tok(prompt, add_special_tokens=False)["input_ids"]
            said = tok(turn.reply[len(tag):], add_special_tokens=False)["input_ids"]
            out.append(Segment(ids + said, [0] * len(ids) + [1] * len(said)))
    return out


def batch_of(cfg: Config, it: int, short: list, train_segs: list, per_epoch: int) -> tuple[int, int, list]:
    """Step `it`'s (epoch, step in it, sequences): the curriculum (epoch -1), then a permutation per epoch,
    seeded so a resumed run draws the same."""
    if it < cfg.short_steps:
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 - it - 1)
        rows = torch.randperm(len(short), generator=gen)[:cfg.short_batch].tolist()
        return -1, it, [short[i] for i in rows]
    epoch, k = divmod(it - cfg.short_steps, per_epoch)
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
    perm = torch.randperm(len(train_segs), generator=gen)
    return epoch, k, [train_segs[i] for i in perm[k * cfg.batch:(k + 1) * cfg.batch].tolist()]


# ---- the update

def masked_logprobs(policy, part: list, cfg: Config, pad_id: int, device, amp):
    """A micro-batch of segments -> log-probs, entropies and the loss mask, [b, T] each (the LM head on
    the trained tokens only)."""
    ids, attn, mask_cpu = pad_segments(part, pad_id)  # [b, T] each
    ids, attn, mask = ids.to(device), attn.to(device), mask_cpu.to(device)
    pre = shared_prefix_len([s.input_ids for s in part])  # the prompt header, run once
    with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
        logp, ent = token_logprobs(policy, ids, attn, 1.0, cfg.fused, prefix_len=pre, positions=mask_cpu)
    return logp, ent, mask


def sft_step(policy, opt, segs, cfg: Config, pad_id: int, device, amp) -> dict:
    """One optimizer step on the token-mean cross-entropy over all micro-batches; one host sync."""
    n_tok = sum(sum(s.loss_mask) for s in segs)
    nll_sum = torch.zeros((), device=device)
    ent_sum = torch.zeros((), device=device)
    for part in sorted_micro_batches(segs, cfg.micro_batch):
        logp, ent, mask = masked_logprobs(policy, part, cfg, pad_id, device, amp)  # [b, T] each
        nll = -(logp.float() * mask).sum()
        (nll / n_tok).backward()
        nll_sum += nll.detach()
        ent_sum += (ent.detach().float() * mask).sum()
    trainable = [p for p in policy.parameters() if p.requires_grad]
    grad_norm = torch.nn.utils.clip_grad_norm_(trainable, cfg.grad_clip)
    finite = torch.isfinite(grad_norm) & torch.isfinite(nll_sum)
    host = torch.stack([nll_sum / n_tok, ent_sum / n_tok, grad_norm.float(), finite.float()]).tolist()
    if host[3]:
        opt.step()
    opt.zero_grad(set_to_none=True)
    return {"train/loss": host[0], "train/entropy": host[1], "train/grad_norm": host[2],
            "train/skipped_nonfinite": 1.0 - host[3], "train/tokens": n_tok, "train/rows": len(segs)}


@torch.no_grad()
def test_loss(policy, segs, cfg: Config, pad_id: int, device, amp) -> float:
    """The token-mean cross-entropy on `segs`."""
    was_training = policy.training
    policy.eval()
    total = torch.zeros((), device=device)
    for part in sorted_micro_batches(segs, cfg.micro_batch):
        logp, _, mask = masked_logprobs(policy, part, cfg, pad_id, device, amp)  # [b, T] each
        total += -(logp.float() * mask).sum()
    policy.train(was_training)
    return total.item() / sum(sum(s.loss_mask) for s in segs)


def lr_factor(step: int, steps: int) -> float:
    """A linear warm-up over 5% of the steps, then a cosine to 0 (the paper gives only the peak)."""
    warmup = max(1, round(WARMUP_FRACTION * steps))
    if step < warmup:
        return (step + 1) / warmup
    return 0.5 * (1 + math.cos(math.pi * (step + 1 - warmup) / (steps - warmup + 1)))


# ---- main

def as_text(trajs: list, tok, n: int) -> str:  # the first n trajectories as text
    return "".join(dump(t, tok) + "\n" for t in trajs[:n])


def main(argv=None):
    # ---- 1. the config: every input checked before anything is written
    with cli.one_line_errors():
        cfg, out = configure(argv)
        start, state, ck = resume_point(cfg, out, "steps")  # 0, or a resumed run's latest checkpoint
        if ck and start == cfg.steps and (out / "result.json").is_file():  # nothing to do, nothing written
            print(f"{out}: the run is complete ({start} steps); evaluate it: python eval.py --policy {out}")
            return out
        t_start = time.time()

        # ---- 2. the setup: device, policy (+ LoRA, App. G), optimizer
        device = pick_device(cfg.device)
        dtype = choose_dtype(cfg.dtype, device, model_kind(cfg.model))
        setup_device(device, cfg.threads, dtype=dtype)
        amp = autocast_dtype(device)  # bf16 autocast or None; fp32 weights
        print(f"{cfg.env} | {cfg.model} | {device}, {dtype}")
        policy, tok, _ = load_policy(cfg.model, device)
        check_budgets(policy, cfg.max_new_tokens, cfg.lora_rank)
        env_kw = {"data_dir": cfg.webshop_data} if cfg.webshop_data else {}
        ENVS[cfg.env](**env_kw)  # a bad env option fails now, before the run folder exists
        if cfg.lora_rank > 0:
            torch.manual_seed(cfg.seed)  # the adapters' init
            layers = add_lora(policy, cfg.lora_rank, cfg.lora_alpha)
            print(f"LoRA r={cfg.lora_rank} alpha={cfg.lora_alpha:g} on {len(layers)} linear layers")
        opt = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=cfg.lr,
                                weight_decay=cfg.weight_decay, betas=(0.9, cfg.adam_beta2))
        kept_metrics = read_metrics(out / "metrics.jsonl", start) if ck else []
    rcfg = RolloutConfig.of(cfg, cfg.eval_temperature)

    # ---- 3. the data: expert trajectories, train and test disjoint; a resumed run's state
    train_s, test_s = data_seeds(cfg.seed, cfg.train_trajectories, cfg.test_trajectories)
    trajs = expert_trajectories(cfg.env, train_s + test_s, rcfg, tok, cfg.expert_actions, env_kw)
    train_trajs, test_trajs = trajs[:cfg.train_trajectories], trajs[cfg.train_trajectories:]
    train_segs = [s for t in train_trajs for s in t.segments]
    test_segs = [s for t in test_trajs for s in t.segments]
    short = short_examples(train_trajs, tok, rcfg) if cfg.short_steps else []
    per_epoch = math.ceil(len(train_segs) / cfg.batch)
    cfg.steps = cfg.short_steps + cfg.epochs * per_epoch
    expert = sum(t.success for t in train_trajs) / len(train_trajs)
    print(f"expert data: {len(train_segs)} train, {len(test_segs)} test sequences (expert success "
          f"{expert:.3f}); {len(short)} short examples")
    if unknown := unknown_words(tok, trajs):
        print(f"warning: no tokens for {unknown} in the expert's replies: trained as <unk>")
    sched = torch.optim.lr_scheduler.LambdaLR(opt, functools.partial(lr_factor, steps=cfg.steps))

    # ---- 4. the run folder: config.json, metrics.jsonl, the expert's trajectories as text
    replace = cfg.overwrite and not cfg.resume
    metrics_path = open_run(out, asdict(cfg), start, kept_metrics, replace, ck, what="step")
    (out / "expert-trajectories.txt").write_text(as_text(train_trajs, tok, cfg.dump_trajectories))
    if state is None:
        initial_loss = test_loss(policy, test_segs, cfg, tok.pad_token_id, device, amp)
        best = {"loss": initial_loss, "epoch": 0, "state": trainable_state(policy)}
        print(f"test loss before training: {initial_loss:.4f}")
    else:
        restore_models(ck, state, policy, None, cfg.lora_rank > 0, f"--resume {out}")
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        initial_loss, best = state["initial_loss"], state["best"]

    # ---- 5. the loop
    from tqdm import tqdm
    bar = tqdm(range(start, cfg.steps), initial=start, total=cfg.steps, desc="SFT", dynamic_ncols=True)
    policy.train()
    it, saved_at = start, start
    try:
        for it in bar:
            t0 = time.time()
            # 1. one optimizer step
            epoch, k, segs = batch_of(cfg, it, short, train_segs, per_epoch)
            m: dict = {"step": it + 1, "epoch": epoch + 1, "train/lr": sched.get_last_lr()[0]}
            m.update(sft_step(policy, opt, segs, cfg, tok.pad_token_id, device, amp))
            sched.step()
            m["time/step"] = time.time() - t0
            # 2. at an epoch's end: the test loss (the lowest kept), an optional eval
            if epoch >= 0 and k == per_epoch - 1:
                t1 = time.time()
                m["test/loss"] = test_loss(policy, test_segs, cfg, tok.pad_token_id, device, amp)
                if m["test/loss"] < best["loss"]:
                    best = {"loss": m["test/loss"], "epoch": epoch + 1, "state": trainable_state(policy)}
                m["test/best_loss"], m["time/test"] = best["loss"], time.time() - t1
                if cfg.eval_every and (epoch + 1) % cfg.eval_every == 0:
                    t2 = time.time()
                    em, _ = evaluate(cfg.env, rcfg, policy, tok, prompts=cfg.eval_prompts, seed=cfg.seed,
                                     env_overrides=env_kw)
                    m.update({**{f"eval/{key}": v for key, v in em.items() if key != "episodes"},
                              "time/eval": time.time() - t2})
            # 3. log, checkpoint
            m["time/iteration"] = time.time() - t0
            append_metrics(metrics_path, m)
            if cfg.save_every and ((it + 1) % cfg.save_every == 0 or it + 1 == cfg.steps):
                saved = {"opt": opt, "sched": sched, "initial_loss": initial_loss, "best": best}
                save_checkpoint(out, it + 1, tok, {"policy": policy}, saved, config=asdict(cfg))
                saved_at = it + 1
            tqdm.write(step_line(m, cfg.steps))
    except KeyboardInterrupt:
        bar.close()
        where = f"step {saved_at}" if saved_at else "none"
        raise KeyboardInterrupt(f"at step {it + 1} (last checkpoint: {where}); continue with: python "
                                f"sft_baseline.py --resume {out}") from None
    bar.close()

    # ---- 6. export: the lowest-test-loss parameters, LoRA merged, one final eval
    policy.load_state_dict(best["state"], strict=False)
    merged = merge_lora(policy)
    policy.eval()
    save_final(out, policy, tok, cfg)
    t0 = time.time()
    em, etrajs = evaluate(cfg.env, rcfg, policy, tok, prompts=cfg.eval_prompts, seed=cfg.seed,
                          env_overrides=env_kw)
    (out / "trajectories-final.txt").write_text(as_text(etrajs, tok, cfg.dump_trajectories))
    result = {"initial_test_loss": initial_loss, "best_epoch": best["epoch"], "best_test_loss": best["loss"],
              "lora_layers_merged": merged, **{f"eval/{key}": v for key, v in em.items()},
              "time/eval": time.time() - t0, "time/total": time.time() - t_start}
    (out / "result.json").write_text(json.dumps(result, indent=2))
    print(f"kept epoch {best['epoch']} (test loss {best['loss']:.4f}); eval success {em['success']:.3f} "
          f"[{em['success_lo']:.3f}, {em['success_hi']:.3f}] on {em['episodes']} prompts; "
          f"total {result['time/total']:.0f}s\nfinal policy: {out / 'final'}")
    return out


if __name__ == "__main__":
    cli.run(main)
