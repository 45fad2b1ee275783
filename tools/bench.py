"""Benchmarks, one section per concept (speed and memory targets live here, never in timed tests).

    python tools/bench.py [fused] [rollout] [prefix] [prior] [gpu] [cpu]   (default: every section but cpu;
                                                                           gpu needs CUDA)

  fused    the fused chunked log-prob/entropy path against full logits at Qwen2.5-0.5B's head: time, peak memory
  rollout  generated tokens/s of the engine against the reference path (re-prefill; one episode at a time),
           on --model and, with --rollout-deep N, on a random N-layer model of the tiny prior's widths
  prefix   the shared prompt header run once per batch against once per row, forward + backward
  prior    the untrained policy's format rate, valid actions and success on every env
  gpu      the GPU check: decode ms/step eager and as CUDA graphs, PPO at the paper's budgets with and without
           a memory cap, one JSON line per configuration (details: docs/engine.md)
  cpu      a hub-size --model (SmolLM2) on this CPU, fp32 against bf16: decode ms/step beside its matmul floor,
           one 32 x 300-token update (python tools/bench.py cpu --model models/smollm2-135m-instruct --threads 2)
Each section prints medians of --repeats runs and ratios measured in the same run. Peak memory: CUDA's
allocator statistics; on a CPU the process's peak RSS (Linux VmHWM, reset before each call). The measured code
runs with --threads 1 by default: 2 threads made small models erratic and up to 10x slower on 2-core machines.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the repository root, for python tools/bench.py
from engine import cli  # noqa: E402
from engine.logprobs import fused_logprobs_entropy, naive_logprobs_entropy  # noqa: E402


# ----------------------------------------------------------------------------------------------------------
# Memory and time measurement
# ----------------------------------------------------------------------------------------------------------

def _proc_status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # "5" resets the peak RSS (VmHWM), Linux >= 4.0
        return True
    except OSError:
        return False


class PeakMemory:
    """Peak memory (bytes) used by the code run between start() and stop(), above what was in use before."""

    def __init__(self, device: torch.device):
        self.device = device
        if device.type == "cuda":
            self.method = "torch.cuda.max_memory_allocated (tensors only)"
        elif _proc_status_kb("VmRSS") is not None and _reset_hwm():
            self.method = "Linux peak RSS (VmHWM reset via /proc/self/clear_refs) minus RSS before"
        elif _proc_status_kb("VmRSS") is not None:
            self.method = "VmRSS sampled every 1 ms by a thread (may miss sub-millisecond peaks)"
        else:
            self.method = "unavailable (no /proc)"

    def start(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
        elif self.method.startswith("Linux"):
            self.base = _proc_status_kb("VmRSS") * 1024
            _reset_hwm()
        elif self.method.startswith("VmRSS"):
            self.base = _proc_status_kb("VmRSS") * 1024
            self.sampled = self.base
            self.running = True

            def sample():
                while self.running:
                    self.sampled = max(self.sampled, _proc_status_kb("VmRSS") * 1024)
                    time.sleep(0.001)

            self.thread = threading.Thread(target=sample, daemon=True)
            self.thread.start()

    def stop(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return float(torch.cuda.max_memory_allocated(self.device) - self.base)
        if self.method.startswith("Linux"):
            return float(_proc_status_kb("VmHWM") * 1024 - self.base)
        if self.method.startswith("VmRSS"):
            self.running = False
            self.thread.join()
            return float(self.sampled - self.base)
        return float("nan")


def _sync(device: torch.device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ----------------------------------------------------------------------------------------------------------
# Section: fused
# ----------------------------------------------------------------------------------------------------------

def bench_fused(args) -> dict:
    """Forward + backward of engine.logprobs.fused_logprobs_entropy against the naive full-logits path, fp32,
    at the Qwen2.5-0.5B head (H = 896, V = 151,936); targets: peak memory <= 1/8 of naive, time <= 1.3x. The
    reference shape, 4 x 1024 tokens (about 12 GB of RAM, 10 minutes on one CPU thread):
        python tools/bench.py fused --fused-seqs 4 --fused-seq-len 1024
    The default 1 x 1024 tokens (the same 4 chunks per call) takes about two minutes; at so few tokens the fixed
    519 MiB weight gradient dominates the fused peak, so read the memory target at the reference shape."""
    device = torch.device(args.device)
    n = args.fused_seqs * args.fused_seq_len
    H, V = args.fused_hidden, args.fused_vocab
    chunk = args.fused_chunk or max(1, min(1024, n // 4))
    gen = torch.Generator().manual_seed(0)
    # a Qwen-like head: logits of std ~ 3, so the softmax is neither flat nor one-hot
    weight = (torch.randn(V, H, generator=gen) * (3.0 / H ** 0.5)).to(device).requires_grad_()  # [V, H]
    hidden = torch.randn(n, H, generator=gen).to(device).requires_grad_()  # [N, H]
    targets = torch.randint(0, V, (n,), generator=gen).to(device)  # [N]
    g_logp = torch.randn(n, generator=gen).to(device)  # upstream grads: a loss that uses both outputs
    g_ent = torch.randn(n, generator=gen).to(device)

    def run(path: str, h, w, t, gl, ge):
        if path == "fused":
            logp, ent = fused_logprobs_entropy(h, w, None, t, 1.0, chunk)
        else:
            logp, ent = naive_logprobs_entropy(h, w, None, t, 1.0)
        ((logp * gl).sum() + (ent * ge).sum()).backward()
        return logp.detach(), ent.detach()

    # warm-up on a few tokens (thread pools, kernel selection), not timed
    k = min(n, 64)
    for path in ("naive", "fused"):
        run(path, hidden[:k].detach().requires_grad_(), weight, targets[:k], g_logp[:k], g_ent[:k])
    weight.grad = None

    meter = PeakMemory(device)
    times = {"naive": [], "fused": []}
    peaks = {"naive": [], "fused": []}
    outputs = {}
    for rep in range(args.repeats):
        order = ("naive", "fused") if rep % 2 == 0 else ("fused", "naive")  # alternate against drift
        for path in order:
            hidden.grad = None
            weight.grad = None
            meter.start()
            _sync(device)
            t0 = time.perf_counter()
            out = run(path, hidden, weight, targets, g_logp, g_ent)
            _sync(device)
            times[path].append(time.perf_counter() - t0)
            peaks[path].append(meter.stop())
            if rep == 0:
                outputs[path] = (out, hidden.grad.clone(), weight.grad.clone())
            del out
    hidden.grad = None
    weight.grad = None

    (lp_f, en_f), gh_f, gw_f = outputs["fused"]
    (lp_n, en_n), gh_n, gw_n = outputs["naive"]
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    med = {p: (statistics.median(times[p]), statistics.median(peaks[p])) for p in times}
    time_ratio = med["fused"][0] / med["naive"][0]
    mem_ratio = med["fused"][1] / med["naive"][1]
    grad_w_mb = V * H * 4 / 2 ** 20

    print(f"[fused] head H={H} V={V}, tokens {args.fused_seqs} x {args.fused_seq_len} = {n}, chunk {chunk}, "
          f"fp32, {device.type}, threads={torch.get_num_threads()}, repeats={args.repeats}")
    print(f"[fused] peak memory: {meter.method}; includes the fp32 [V, H] weight gradient "
          f"({grad_w_mb:.0f} MiB) in both paths")
    print(f"[fused] {'path':6s} {'time s (median; all)':34s} {'peak MiB (median)':>18s}")
    for p in ("naive", "fused"):
        all_t = ", ".join(f"{t:.2f}" for t in times[p])
        print(f"[fused] {p:6s} {med[p][0]:8.3f}  ({all_t}){'':{max(0, 22 - len(all_t))}s} "
              f"{med[p][1] / 2 ** 20:18.0f}")
    print(f"[fused] ratio fused/naive: time {time_ratio:.2f}x (target <= 1.3x), peak memory {mem_ratio:.3f} "
          f"(target <= 0.125)")
    grad_w = V * H * 4
    print(f"[fused] peak memory beyond the weight gradient both paths need: fused/naive "
          f"{(med['fused'][1] - grad_w) / (med['naive'][1] - grad_w):.3f}")
    print(f"[fused] fused vs naive rel. error: logp {rel(lp_f, lp_n):.1e}, entropy {rel(en_f, en_n):.1e}, "
          f"grad hidden {rel(gh_f, gh_n):.1e}, grad weight {rel(gw_f, gw_n):.1e}")
    return {"time_naive_s": med["naive"][0], "time_fused_s": med["fused"][0], "peak_naive_mib":
            med["naive"][1] / 2 ** 20, "peak_fused_mib": med["fused"][1] / 2 ** 20, "time_ratio": time_ratio,
            "memory_ratio": mem_ratio}


# ----------------------------------------------------------------------------------------------------------
# Section: rollout
# ----------------------------------------------------------------------------------------------------------

def _load(args):
    from engine.models import load_policy
    model, tok, path = load_policy(args.model, device=args.device)
    return model.eval(), tok, path


def _deep_copy_of_prior(layers: int, device):
    """A random Qwen2 with the tiny prior's tokenizer and widths but `layers` layers: the per-layer work that a
    real model has and the prior lacks (review of 73ef042: the engine was 1.15x slower on the prior, 1.16x on
    24 layers). Random weights rarely end a reply, so replies run to the token budget."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from engine.models import PRIOR_DIR, load_policy
    _, tok, _ = load_policy("tiny", device=device)
    config = AutoConfig.from_pretrained(PRIOR_DIR)
    config.num_hidden_layers = layers
    config.layer_types = ["full_attention"] * layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).to(device).eval(), tok


def bench_rollout(args) -> dict:
    """Generated tokens/s of one P x N rollout three ways: one episode at a time (each turn re-prefills its whole
    conversation), all episodes in one batch re-prefilling (RolloutConfig.kv_cache=False), and the engine (the
    default: each episode's KV cache kept, each group's first prompt prefilled once); medians of --repeats runs
    and the ratios within each run, the peak memory of each, then whether they sample the same trajectories
    (token ids, loss masks, rewards): all three greedy, and the two batched ones at the benchmark's temperature,
    which draw from one generator in the same order. With --rollout-deep N, the two batched ways again on a
    random N-layer copy of the tiny prior (one at a time would take too long there)."""
    from engine.models import load_policy
    device = torch.device(args.device)
    model, tok, path = load_policy(args.model, device=device)
    out = {"model": _rollout_one(args, model.eval(), tok, f"{args.model} ({path})", single=True)}
    if args.rollout_deep:
        del model
        deep, tok = _deep_copy_of_prior(args.rollout_deep, device)
        out["deep"] = _rollout_one(args, deep, tok, f"random {args.rollout_deep}-layer copy of tiny", single=False)
    return {**out["model"], **({"deep": out["deep"]} if "deep" in out else {})}


def _rollout_one(args, model, tok, label: str, single: bool) -> dict:
    from envs import EVAL_SEEDS
    from rollout import RolloutConfig, rollout
    P, N = args.rollout_prompts, args.rollout_n
    seeds = [s for s in EVAL_SEEDS[:P] for _ in range(N)]            # P prompts x N rollouts, grouped
    groups = [g for g in range(P) for _ in range(N)]
    samples = [k for _ in range(P) for k in range(N)]
    cfg = RolloutConfig(temperature=args.rollout_temperature)
    device = torch.device(args.device)

    def batched(gen, c):
        return rollout(args.rollout_env, seeds, groups, c, tokenizer=tok, model=model, generator=gen,
                       samples=samples)

    def one_at_a_time(gen, c):
        return [t for s, g, k in zip(seeds, groups, samples)
                for t in rollout(args.rollout_env, [s], [g], c, tokenizer=tok, model=model, generator=gen,
                                 samples=[k])]

    runs = {"one at a time": (one_at_a_time, False), "batched, re-prefill": (batched, False),
            "batched, KV kept": (batched, True)}
    if not single:
        del runs["one at a time"]
    rates = {name: [] for name in runs}
    peaks = {name: [] for name in runs}
    ratios = {"KV kept / one at a time": [], "KV kept / re-prefill": []}
    if not single:
        del ratios["KV kept / one at a time"]
    detail = {}
    meter = PeakMemory(device)
    batched(torch.Generator(device).manual_seed(0), cfg)             # warm-up: kernels, caches (not timed)
    for rep in range(args.repeats):
        order = list(runs) if rep % 2 == 0 else list(runs)[::-1]    # alternate against drift
        for name in order:
            fn, kv = runs[name]
            gen = torch.Generator(device).manual_seed(rep)
            meter.start()
            t0 = time.perf_counter()
            trajs = fn(gen, dataclasses.replace(cfg, kv_cache=kv))
            _sync(device)
            dt = time.perf_counter() - t0
            peaks[name].append(meter.stop())
            tokens = sum(t.response_tokens for tr in trajs for t in tr.turns)
            rates[name].append(tokens / dt)
            detail[name] = (tokens, dt, sum(len(tr.turns) for tr in trajs))
        for name in ratios:
            base = "one at a time" if name.endswith("one at a time") else "batched, re-prefill"
            ratios[name].append(rates["batched, KV kept"][-1] / rates[base][-1])

    def same(a, b) -> int:
        return sum(x.segments[0].input_ids == y.segments[0].input_ids and x.segments[0].loss_mask ==
                   y.segments[0].loss_mask and x.reward == y.reward for x, y in zip(a, b))
    greedy = dataclasses.replace(cfg, temperature=0.0)
    g = {name: fn(torch.Generator(device).manual_seed(0), dataclasses.replace(greedy, kv_cache=kv))
         for name, (fn, kv) in runs.items()}
    t = {kv: batched(torch.Generator(device).manual_seed(0), dataclasses.replace(cfg, kv_cache=kv))
         for kv in (False, True)}
    med = {k: statistics.median(v) for k, v in {**rates, **ratios}.items()}
    print(f"[rollout] model {label}, env {args.rollout_env}, {P} prompts x {N} rollouts, temperature "
          f"{cfg.temperature}, {device.type}, threads={torch.get_num_threads()}, repeats={args.repeats}; "
          f"peak memory: {meter.method}")
    for name in runs:
        tokens, dt, turns = detail[name]
        all_r = ", ".join(f"{r:.0f}" for r in rates[name])
        print(f"[rollout] {name:20s} {med[name]:7.0f} generated tokens/s (median; all: {all_r}); last run "
              f"{tokens} tokens in {turns} turns, {dt:.1f} s; peak {statistics.median(peaks[name]) / 2 ** 20:.0f} MiB")
    for name, v in ratios.items():
        print(f"[rollout] {name} (same run): {med[name]:.2f}x (median; all: {', '.join(f'{r:.2f}' for r in v)})")
    n = len(seeds)
    pairs = list(zip(list(g)[:-1], list(g)[1:]))
    same_greedy = {f"{a} = {b}": same(g[a], g[b]) for a, b in pairs}
    print("[rollout] same trajectories (ids, masks, rewards), greedy: "
          + ", ".join(f"{k} {v}/{n}" for k, v in same_greedy.items())
          + f"; temperature {cfg.temperature}: re-prefill = KV kept {same(t[False], t[True])}/{n}")
    return {"tokens_per_s_single": med.get("one at a time"), "tokens_per_s_reprefill": med["batched, re-prefill"],
            "tokens_per_s_kv": med["batched, KV kept"], "ratio_single": med.get("KV kept / one at a time"),
            "ratio_reprefill": med["KV kept / re-prefill"], "same_sampled": same(t[False], t[True]),
            "same_greedy": min(same_greedy.values()), "episodes": n}


# ----------------------------------------------------------------------------------------------------------
# Section: prefix
# ----------------------------------------------------------------------------------------------------------

def bench_prefix(args) -> dict:
    """Forward + backward of token_logprobs on one SFT batch with the shared prompt header run once vs per row."""
    from eval import expert_agent
    from rollout import RolloutConfig, rollout
    from engine.logprobs import pad_segments, shared_prefix_len
    from starpo import token_logprobs
    model, tok, path = _load(args)
    model.train()
    cfg = RolloutConfig(context_turns=1)  # sft_baseline.py's tiny default: one example per turn
    seeds = list(range(10_000, 10_000 + args.prefix_rows))
    trajs = rollout(args.rollout_env, seeds, list(range(len(seeds))), cfg, tokenizer=tok, agent=expert_agent(2))
    segs = [s for t in trajs for s in t.segments][:args.prefix_rows]
    ids, attn, mask = (x.to(args.device) for x in pad_segments(segs, tok.pad_token_id))  # [B, T]
    shared = shared_prefix_len([s.input_ids for s in segs])
    variants = {"plain": (0, None), "shared header": (shared, None), "+ head on replies": (shared, mask.cpu())}
    times = {name: [] for name in variants}
    for rep in range(args.repeats + 1):  # the first round warms up, untimed
        for name, (pre, pos) in list(variants.items())[::1 if rep % 2 == 0 else -1]:
            model.zero_grad(set_to_none=True)
            _sync(torch.device(args.device))
            t0 = time.perf_counter()
            logp, _ = token_logprobs(model, ids, attn, 1.0, True, prefix_len=pre, positions=pos)
            (-(logp * mask).sum() / mask.sum()).backward()
            _sync(torch.device(args.device))
            if rep:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"[prefix] model {args.model} ({path}), {args.rollout_env} 1-turn windows, {len(segs)} rows of "
          f"{ids.shape[1]} tokens, {shared} shared, repeats={args.repeats}")
    for name, v in times.items():
        print(f"[prefix] {name:17s} {med[name]:.3f} s per forward+backward (median; all: "
              f"{', '.join(f'{x:.3f}' for x in v)})")
    head_gain = med["shared header"] / med["+ head on replies"]
    print(f"[prefix] plain / shared header: {med['plain'] / med['shared header']:.2f}x; shared header / + head "
          f"on the {int(mask.sum())} reply tokens of {int(attn.sum())}: {head_gain:.2f}x")
    return {"plain_s": med["plain"], "shared_s": med["shared header"], "replies_s": med["+ head on replies"],
            "shared_tokens": shared}


# ----------------------------------------------------------------------------------------------------------
# Section: prior
# ----------------------------------------------------------------------------------------------------------

def bench_prior(args) -> dict:
    """The untrained policy on every env: well-formed replies, valid actions, success, vs the random agent."""
    import random
    from envs import ENVS, EVAL_SEEDS
    from eval import random_agent
    from rollout import RolloutConfig, rollout
    model, tok, path = _load(args)
    seeds = EVAL_SEEDS[:args.prior_episodes]
    groups = list(range(len(seeds)))
    temps = [float(t) for t in args.prior_temperatures.split(",")]
    device = torch.device(args.device)
    print(f"[prior] model {args.model} ({path}), {len(seeds)} episodes per row (eval seeds "
          f"{seeds[0]}..{seeds[-1]}), budgets 5 turns / 5 per turn / 10 per episode, {device.type}")
    print("[prior] parsed = well-formed turns / turns; valid = valid actions / actions attempted; "
          "success = episodes; random = the random agent's success on the same seeds")
    head = "| env | mode | " + " | ".join(f"T={t:g} parsed | valid | success" for t in temps) + " | random |"
    print("[prior] " + head)
    print("[prior] " + "|---" * (3 + 3 * len(temps)) + "|")
    results, t0 = {}, time.perf_counter()
    for env in sorted(ENVS):
        rnd = rollout(env, seeds, groups, RolloutConfig(), agent=random_agent(random.Random(0)))
        rnd_success = sum(t.success for t in rnd) / len(rnd)
        for think in (True, False):
            cells = []
            for temp in temps:
                cfg = RolloutConfig(think=think, temperature=temp)
                trajs = rollout(env, seeds, groups, cfg, tokenizer=tok, model=model,
                                generator=torch.Generator(device).manual_seed(0))
                turns = [t for tr in trajs for t in tr.turns]
                parsed = sum(t.parsed for t in turns) / len(turns)
                valid = sum(tr.valid_actions for tr in trajs) / max(1, sum(tr.num_actions for tr in trajs))
                success = sum(tr.success for tr in trajs) / len(trajs)
                results[(env, think, temp)] = dict(parsed=parsed, valid=valid, success=success,
                                                   random_success=rnd_success)
                cells.append(f"{parsed:.0%} | {valid:.0%} | {success:.0%}")
            mode = "think" if think else "no-think"
            print(f"[prior] | {env} | {mode} | " + " | ".join(cells) + f" | {rnd_success:.0%} |", flush=True)
    worst = min(r["parsed"] for r in results.values())
    print(f"[prior] lowest parsed rate over all rows: {worst:.1%} (target >= 90%); "
          f"{time.perf_counter() - t0:.0f} s")
    return {"min_parsed": worst, "rows": {f"{e}/{'think' if th else 'no-think'}/T={t:g}": r
                                         for (e, th, t), r in results.items()}}


# ----------------------------------------------------------------------------------------------------------
# Section: gpu
# ----------------------------------------------------------------------------------------------------------

QWEN_05B = dict(layers=24, hidden=896, heads=14, kv_heads=2, intermediate=4864, vocab=151936)  # published shapes


QWEN_3B = dict(layers=36, hidden=2048, heads=16, kv_heads=2, intermediate=11008, vocab=151936)  # RAGEN's default now


def _random_model(args, shapes: dict, tmp):
    """A Qwen2 model of these shapes with random weights (a lent GPU machine has no hub access) and a tokenizer
    built from rollout text, saved in `tmp`; -> (its folder, parameters)."""
    import random
    from pathlib import Path

    from envs import train_seeds
    from tools.prior import build_tokenizer
    from eval import random_agent
    from rollout import RolloutConfig, rollout
    from transformers import Qwen2Config, Qwen2ForCausalLM
    trajs = rollout("sokoban", train_seeds(0, 16), list(range(16)), RolloutConfig(),
                    agent=random_agent(random.Random(0)))
    texts = [m["content"] for t in trajs for m in t.messages] + [f"{r}\n" for r in ("system", "user", "assistant")]
    tok = build_tokenizer(texts + ["Reward: -0.1\nInvalid format or action.\n"], size=shapes["vocab"])
    config = Qwen2Config(vocab_size=shapes["vocab"], hidden_size=shapes["hidden"],
                         intermediate_size=shapes["intermediate"], num_hidden_layers=shapes["layers"],
                         num_attention_heads=shapes["heads"], num_key_value_heads=shapes["kv_heads"],
                         max_position_embeddings=32768, rope_theta=1e6, tie_word_embeddings=True,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    folder = Path(tmp) / f"model-{shapes['layers']}x{shapes['hidden']}"
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder, sum(p.numel() for p in model.parameters())


def _decode_ms(folder, args, graphs: bool) -> dict:
    """The engine's decode step at P x N rows (128 at the paper's batch): one engine, first-turn Sokoban prompts;
    (time of a reply of S + 1 tokens - time of 1 token) / S, medians of --repeats. Random weights almost never
    end a reply, so every row decodes every step."""
    from envs import make_env, train_seeds
    from engine.models import autocast_dtype, load_policy
    from rollout import RolloutConfig, header_text, render_ids, turn_text, window_messages
    from engine.sampler import Engine
    device = torch.device(args.device)
    model, tok, _ = load_policy(str(folder), device)
    model.eval()
    cfg, rows = RolloutConfig(), args.gpu_prompts * args.gpu_rollouts
    prompts = []
    for s in train_seeds(0, args.gpu_prompts):
        e = make_env("sokoban")
        p = render_ids(tok, window_messages(header_text(e, cfg), [turn_text(1, e.reset(s), cfg.max_actions, cfg)], [], 0), cfg)
        prompts += [p] * args.gpu_rollouts
    engine = Engine(model, tok, rows, graphs=graphs)
    amp = autocast_dtype(device)
    steps = args.gpu_decode_steps
    engine.reserve(max(map(len, prompts)) + 2 * steps + 8)  # one capacity for every call below: no re-capture

    def timed(n: int) -> tuple[float, int]:
        gen = torch.Generator(device).manual_seed(0)
        _sync(device)
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=amp, enabled=amp is not None):
            out = engine.generate(list(range(rows)), prompts, n, 1.0, gen)
        _sync(device)
        return time.perf_counter() - t0, max(map(len, out))

    timed(steps + 1)  # warm-up: kernels, the graphs' capture
    per_step = []
    for _ in range(args.repeats):
        (long, n), (short, _) = timed(steps + 1), timed(1)
        per_step.append((long - short) / max(1, n - 1) * 1e3)
    del engine, model
    return {"decode_ms_per_step": statistics.median(per_step), "decode_ms_all": per_step, "rows": rows,
            "decode_steps": steps}


def _iteration(folder, args, algo: str, cap: float | None, extra: list[str], tmp) -> dict:
    """--gpu-iterations training iterations at the paper's budgets (critic included for PPO), the last one with
    a real eval of --gpu-eval-prompts prompts, run as `python train.py` in a process of its own: its own CUDA
    allocator (a cap starts from an empty cache, not one the previous configuration filled), and an exit or a
    crash stays inside this configuration. Every reply runs to --gpu-reply tokens (random weights never close
    their answer). Times are the last iteration's, without its eval; peaks are the allocator's over the run."""
    import json
    import os
    import subprocess
    run = Path(tmp) / f"run-{algo}-{cap}-{len(extra)}"
    cmd = [sys.executable, str(ROOT / "train.py"), "--env", "sokoban", "--algo", algo, "--model", str(folder),
           "--prompts", str(args.gpu_prompts), "--rollouts", str(args.gpu_rollouts), "--max-turns", "5",
           "--max-new-tokens", str(args.gpu_reply), "--filter", str(args.gpu_filter),
           "--steps", str(args.gpu_iterations), "--eval-every", "0", "--eval-prompts", str(args.gpu_eval_prompts),
           "--save-every", "0", "--device", args.device, "--threads", str(args.threads), "--out", str(run),
           *(["--memory-cap", f"{cap:g}"] if cap else []), *extra]
    log = Path(tmp) / f"{run.name}.log"
    with open(log, "w") as f:  # a file, not a pipe: nothing to drain while waiting
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak RSS, not every child's
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        tail = [line for line in log.read_text().splitlines() if line.strip()][-1:] or ["(no output)"]
        raise RuntimeError(f"train.py exited {proc.returncode}: {tail[0][:300]}")
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = rows[-1]  # the first iteration also pays for kernels' first calls and AdamW's state
    alloc, reserved = last.get("memory/peak_allocated_gib"), last.get("memory/peak_reserved_gib")
    return {"rollout_s": last["time/rollout"], "update_s": last.get("time/prep", 0) + last.get("time/update", 0),
            "iteration_s": last["time/iteration"] - last.get("time/eval", 0), "eval_s": last.get("time/eval"),
            "peak_allocated_gib": alloc, "peak_reserved_gib": reserved, "peak_rss_gib": usage.ru_maxrss / 2 ** 20,
            "under_cap": None if cap is None or reserved is None else reserved < cap,
            "response_length": last["rollout/response_length"], "turns": last["rollout/turns"],
            "train_rows": last.get("train/rows"), "iterations": len(rows),
            "eval_success": last.get("eval/success"), "eval_prompts": args.gpu_eval_prompts}


def bench_gpu(args) -> dict:
    """The GPU check, one JSON line per configuration: the engine's decode step eager and as CUDA graphs at
    P x N rows, PPO at the paper's budgets, the same under --gpu-cap with --grad-checkpoint, and with --gpu-3b
    GRPO + LoRA on Qwen2.5-3B widths under the cap. Random weights with the real shapes, no download. A
    configuration that fails (out of memory, an exit, an exception) leaves its error in its line and the next one
    runs. On a CPU (--device cpu, small --layers) the CUDA-only configurations say why they are skipped."""
    import json
    import tempfile
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    card = torch.cuda.get_device_name(device) if cuda else f"cpu ({torch.get_num_threads()} threads)"
    shapes = {k: getattr(args, k) for k in QWEN_05B}
    results = []

    def emit(name: str, shape: dict, fn):
        row = {"config": name, "device": card, "shapes": shape, "decode_ms_per_step": None, "rollout_s": None,
               "update_s": None, "iteration_s": None, "peak_allocated_gib": None, "peak_reserved_gib": None}
        try:
            row.update(fn())
        except (Exception, SystemExit) as e:  # a measured answer too (it does not fit), or a defect to report
            kind = "out of memory" if isinstance(e, torch.cuda.OutOfMemoryError) else type(e).__name__
            row["error"] = f"{kind}: {(str(e).splitlines() or [''])[0][:300]}"
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
        print(json.dumps(row), flush=True)
        results.append(row)

    skip = {"skipped": "needs CUDA"}
    with tempfile.TemporaryDirectory() as tmp:
        folder, n = _random_model(args, shapes, tmp)
        shapes["parameters"] = n
        emit("engine, eager", shapes, lambda: _decode_ms(folder, args, graphs=False))
        emit("engine, CUDA graphs", shapes, lambda: _decode_ms(folder, args, graphs=True) if cuda else skip)
        emit("PPO, paper budgets", shapes, lambda: _iteration(folder, args, "ppo", None, [], tmp))
        emit(f"PPO, {args.gpu_cap:g} GiB cap, --grad-checkpoint", shapes,
             lambda: _iteration(folder, args, "ppo", args.gpu_cap, ["--grad-checkpoint"], tmp) if cuda else skip)
        if args.gpu_3b:  # --layers other than 24 (a quick check) applies here too
            big = dict(QWEN_3B, layers=QWEN_3B["layers"] if args.layers == QWEN_05B["layers"] else args.layers)

            def three_b():
                folder3, big["parameters"] = _random_model(args, big, tmp)
                return _iteration(folder3, args, "grpo", args.gpu_cap if cuda else None,
                                  ["--lora-rank", "64", "--grad-checkpoint"], tmp)
            emit(f"GRPO, 3B shapes, LoRA 64, {args.gpu_cap:g} GiB cap", big, three_b)
    return {"configs": results}


# ----------------------------------------------------------------------------------------------------------
# Section: cpu (a hub-size model on a laptop: fp32 against bf16)
# ----------------------------------------------------------------------------------------------------------

def _matmul_floor_ms(model, rows: int, dtype: torch.dtype, repeats: int) -> float:
    """One decode step's matmuls alone at `rows` rows: every decoder layer's seven projections and the LM head,
    on weights of the model's shapes in `dtype` (no attention, no sampling, no Python of the engine): the floor
    a decode step of this model cannot beat on this machine."""
    import torch.nn.functional as F
    shapes = [m.weight.shape for layer in model.model.layers for m in layer.modules()
              if isinstance(m, torch.nn.Linear)] + [model.get_output_embeddings().weight.shape]
    weights = [torch.randn(s, dtype=dtype) * 0.02 for s in shapes]
    xs = {s[1]: torch.randn(rows, s[1], dtype=dtype) for s in shapes}

    def step():
        for w in weights:
            F.linear(xs[w.shape[1]], w)
    step()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(10):
            step()
        times.append((time.perf_counter() - t0) / 10 * 1e3)
    return statistics.median(times)


def _update_s(model, tok, args) -> float:
    """One optimizer step of `starpo.update` on 32 sequences of --cpu-update-tokens tokens (a mini-batch of the
    paper's size), micro-batches of 4, under the process's autocast; median seconds of --repeats."""
    from engine.models import autocast_dtype
    from starpo import Batch, UpdateConfig, update
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, len(tok), (32, args.cpu_update_tokens), generator=g)
    mask = torch.zeros(ids.shape)
    mask[:, args.cpu_update_tokens // 2:] = 1  # the second half sampled, as a reply after its prompt
    batch = Batch(input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=mask,
                  advantages=torch.randn(ids.shape, generator=g) * mask)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-6)
    ucfg = UpdateConfig(mini_batch=32, micro_batch=4)
    model.train()
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        update(model, opt, batch, ucfg, autocast_dtype=autocast_dtype(torch.device("cpu")))
        times.append(time.perf_counter() - t0)
    model.eval()
    return statistics.median(times)


def bench_cpu(args) -> dict:
    """--model (SmolLM2-135M-Instruct from tools/fetch_smollm2.py) on this CPU, fp32 then bf16 in one process:
    the engine's decode step at --cpu-rows rows (_decode_ms) beside the matmul floor of that step in the same
    dtype, and one update of 32 x --cpu-update-tokens tokens (LoRA rank 8 on every linear layer, as the README's
    SmolLM2 runs). bf16 pays off only where the CPU has it natively (engine/models.native_bf16)."""
    import copy
    import json
    from engine.lora import add_lora
    from engine.models import native_bf16, setup_device
    device = torch.device("cpu")
    base, tok, path = _load(args)
    rows = args.cpu_rows
    out = {"model": path, "threads": args.threads, "native_bf16": native_bf16(), "rows": rows}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        setup_device(device, args.threads, dtype=name)
        dargs = argparse.Namespace(**vars(args))
        dargs.gpu_prompts, dargs.gpu_rollouts, dargs.gpu_decode_steps = rows // 8, 8, args.cpu_decode_steps
        decode = _decode_ms(path, dargs, graphs=False)["decode_ms_per_step"]
        floor = _matmul_floor_ms(base, rows, dtype, args.repeats)
        model = copy.deepcopy(base)
        torch.manual_seed(0)
        add_lora(model, 8, 32.0)
        out[name] = {"decode_ms_per_step": decode, "matmul_floor_ms": floor, "decode_over_floor": decode / floor,
                     "update_s": _update_s(model, tok, args)}
        print(json.dumps({name: out[name]}), flush=True)
    setup_device(device, args.threads, dtype="fp32")
    out["bf16_speedup_decode"] = out["fp32"]["decode_ms_per_step"] / out["bf16"]["decode_ms_per_step"]
    out["bf16_speedup_update"] = out["fp32"]["update_s"] / out["bf16"]["update_s"]
    print(json.dumps({k: v for k, v in out.items() if k not in ("fp32", "bf16")}), flush=True)
    return out


SECTIONS = {
    "fused": bench_fused,
    "rollout": bench_rollout,
    "prefix": bench_prefix,
    "prior": bench_prior,
    "gpu": bench_gpu,
    "cpu": bench_cpu,
}


def main(argv=None):
    parser = cli.Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("sections", nargs="*", help=f"sections to run, any of {list(SECTIONS)}; default: all")
    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda where there is one)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1, see docstring)")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per path (median reported)")
    parser.add_argument("--fused-seqs", type=int, default=1, help="sequences (reference shape: 4)")
    parser.add_argument("--fused-seq-len", type=int, default=1024, help="tokens per sequence (reference: 1024)")
    parser.add_argument("--fused-hidden", type=int, default=896, help="H, Qwen2.5-0.5B: 896")
    parser.add_argument("--fused-vocab", type=int, default=151936, help="V, Qwen2.5: 151936")
    parser.add_argument("--fused-chunk", type=int, default=None,
                        help="tokens per chunk of the fused path (default: tokens / 4, at most 1024, i.e. 1024 "
                             "= UpdateConfig.chunk_size at the reference shape)")
    parser.add_argument("--model", default="tiny", help="policy for rollout/prior: tiny, a folder or a hub id")
    parser.add_argument("--rollout-env", default="sokoban")
    parser.add_argument("--rollout-prompts", type=int, default=8, help="P prompts (paper: 8)")
    parser.add_argument("--rollout-n", type=int, default=16, help="N rollouts per prompt (paper: 16)")
    parser.add_argument("--rollout-deep", type=int, default=0,
                        help="rollout: also a random copy of the tiny prior with this many layers (0: off; try 24)")
    parser.add_argument("--rollout-temperature", type=cli.finite_float, default=1.0, help="training temperature 1.0")
    parser.add_argument("--prefix-rows", type=int, default=32, help="SFT rows per batch (the tiny default 32)")
    parser.add_argument("--prior-episodes", type=int, default=64, help="episodes per env/mode/temperature")
    parser.add_argument("--prior-temperatures", default="0.5,1.0", help="eval 0.5, training 1.0")
    for name, value in QWEN_05B.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=value,
                            help=f"gpu: model {name.replace('_', ' ')} (Qwen2.5-0.5B: {value})")
    parser.add_argument("--gpu-prompts", type=int, default=8, help="gpu: P prompts (paper: 8)")
    parser.add_argument("--gpu-rollouts", type=int, default=16, help="gpu: N rollouts per prompt (paper: 16)")
    parser.add_argument("--gpu-reply", type=int, default=400, help="gpu: tokens per reply (RAGEN: 400)")
    parser.add_argument("--gpu-filter", type=cli.finite_float, default=0.25, help="gpu: groups kept (StarPO-S: 0.25)")
    parser.add_argument("--gpu-iterations", type=int, default=2,
                        help="gpu: training iterations per configuration (the last one is reported, with an eval)")
    parser.add_argument("--gpu-eval-prompts", type=int, default=256, help="gpu: eval prompts (paper: 256)")
    parser.add_argument("--gpu-cap", type=cli.finite_float, default=22.5,
                        help="gpu: the memory cap in GiB (a 24 GB card leaves the allocator about 23.3)")
    parser.add_argument("--gpu-decode-steps", type=int, default=128, help="gpu: decode steps timed per repeat")
    parser.add_argument("--gpu-3b", action="store_true", help="gpu: also GRPO + LoRA 64 on Qwen2.5-3B shapes")
    parser.add_argument("--cpu-rows", type=int, default=64, help="cpu: rows decoded together (8 x 8)")
    parser.add_argument("--cpu-update-tokens", type=int, default=300, help="cpu: tokens per updated sequence")
    parser.add_argument("--cpu-decode-steps", type=int, default=32, help="cpu: decode steps timed per repeat")
    args = parser.parse_args(argv)
    unknown = [s for s in args.sections if s not in SECTIONS]
    counts = ["threads", "repeats", "fused_seqs", "fused_seq_len", "fused_hidden", "fused_vocab", "rollout_prompts",
              "prefix_rows", "prior_episodes", *QWEN_05B, "gpu_prompts", "gpu_reply", "gpu_iterations", "gpu_decode_steps",
              "gpu_eval_prompts", "cpu_rows", "cpu_update_tokens",
              "cpu_decode_steps"]
    try:
        cli.check([(not unknown, f"unknown section(s) {', '.join(unknown)}; choose from {', '.join(SECTIONS)}")]
                  + [(getattr(args, k) >= 1, f"--{k.replace('_', '-')} {getattr(args, k)}: must be >= 1")
                     for k in counts]
                  + [(args.rollout_n >= 2, f"--rollout-n {args.rollout_n}: must be >= 2"),
                     (args.gpu_rollouts >= 2, f"--gpu-rollouts {args.gpu_rollouts}: must be >= 2"),
                     (args.fused_chunk is None or args.fused_chunk >= 1,
                      f"--fused-chunk {args.fused_chunk}: must be >= 1"),
                     (args.rollout_temperature >= 0, f"--rollout-temperature {args.rollout_temperature}: must be >= 0"),
                     (0 < args.gpu_filter <= 1, f"--gpu-filter {args.gpu_filter}: must be in (0, 1]"),
                     (args.gpu_cap > 0, f"--gpu-cap {args.gpu_cap:g}: must be > 0 (GiB)")])
        temps = [cli.finite_float(t) for t in args.prior_temperatures.split(",")]
        cli.check([(all(t >= 0 for t in temps), f"--prior-temperatures {args.prior_temperatures}: must be >= 0")])
        from engine.models import pick_device
        sections = args.sections or [s for s in SECTIONS if s != "cpu"]  # cpu: asked for by name
        if args.device is None and not torch.cuda.is_available() and "gpu" in sections:
            if args.sections:  # asked for by name: say at once why it cannot run here
                cli.fail("gpu: no CUDA device here; it measures a GPU (to try it on a CPU with small "
                         "shapes: python tools/bench.py gpu --device cpu --layers 2 --hidden 64 --vocab 2000)")
            print("[gpu] skipped: no CUDA device here (python tools/bench.py gpu --device cpu ... tries it on a CPU)")
            sections.remove("gpu")
        args.device = str(pick_device(args.device or "auto"))
    except (ValueError, argparse.ArgumentTypeError) as e:
        cli.fail(f"--prior-temperatures {args.prior_temperatures}: {e}" if isinstance(e, argparse.ArgumentTypeError)
                 else str(e))
    torch.set_num_threads(args.threads)  # the CPU side of every section, whatever the device
    from engine.models import setup_device
    setup_device(torch.device(args.device), args.threads)
    results = {}
    for name in sections:
        results[name] = SECTIONS[name](args)
    return results


if __name__ == "__main__":
    cli.run(main)
