"""Data-parallel training (distributed.py, starpo.update(shard=...), train.py under torchrun), on CPU with gloo.

    python -m pytest -q tests/test_distributed.py

Two processes on 127.0.0.1 (a free port): `torch.multiprocessing.spawn` for the unit checks (the filter sees the
same groups as one process, one update equals the single-process update, drift between ranks is caught) and
`torchrun` for train.py itself (a run finishes with bitwise identical weights on both ranks; resume reproduces
it). One thread per process; the whole file takes well under a minute.
"""
import copy
import io
import json
import math
import os
import shutil
import socket
import subprocess
import sys
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import distributed as dist  # noqa: E402
from engine.distributed import micro_batches  # noqa: E402

ENV = {"GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "MASTER_ADDR": "127.0.0.1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_micro_batches_match_across_ranks_and_cover_every_row_once():
    for n in range(1, 12):
        for world in range(1, 5):
            for micro in range(1, 4):
                plans = [micro_batches(n, micro, r, world) for r in range(world)]
                assert len({len(p) for p in plans}) == 1, (n, world, micro)  # equal all-reduce counts
                rows = sorted(i for p in plans for mb in p for i in mb)
                assert rows == list(range(n)), (n, world, micro)
                assert all(len(mb) <= micro for p in plans for mb in p)
        assert micro_batches(n, 2) == [list(range(n))[s:s + 2] for s in range(0, n, 2)]  # one process: as before


def test_init_on_cuda_takes_the_local_rank_device_and_nccl(monkeypatch):
    """The CUDA branch of init() without a GPU: torch's calls recorded, not made (a one-GPU machine cannot run
    two NCCL ranks, so this path is otherwise only exercised on several GPUs)."""
    calls = []
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append(("set_device", d)))
    monkeypatch.setattr(dist.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist.dist, "init_process_group", lambda backend, **kw: calls.append((backend, kw["device_id"])))
    assert dist.init(torch.device("cuda")) == torch.device("cuda", 1)
    assert calls == [("set_device", torch.device("cuda", 1)), ("nccl", torch.device("cuda", 1))]


# ------------------------------------------------------------------------------------------- spawned workers

def tiny_models(seed: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Model
    from starpo import Critic
    cfg = Qwen2Config(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
    torch.manual_seed(seed)
    policy = Qwen2ForCausalLM(cfg)
    critic = Critic(Qwen2Model(cfg))
    torch.nn.init.normal_(critic.value_head.weight, std=0.1)  # not zero: the critic's gradient is not trivial
    return policy, critic


def fixed_batch(policy, B=7, T=14):
    """Rows of different lengths and sampled-token counts; old/ref log-probs off the current policy (ratios != 1)."""
    from starpo import token_logprobs
    from starpo import Batch
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(4, 40, (B, T), generator=g)
    lengths = torch.tensor([14, 9, 12, 6, 14, 11, 8])[:B]
    attn = (torch.arange(T)[None] < lengths[:, None]).long()  # [B, T]
    mask = ((torch.arange(T)[None] >= 3) & (attn > 0) & (torch.rand(B, T, generator=g) < 0.8)).float()
    with torch.no_grad():
        logp = token_logprobs(policy, ids, attn)[0]
    noise = lambda: 0.1 * torch.randn(B, T, generator=g)  # noqa: E731
    return Batch(input_ids=ids, attention_mask=attn, loss_mask=mask, old_logp=logp + noise(),
                 advantages=torch.randn(B, T, generator=g), ref_logp=logp + noise(),
                 returns=torch.randn(B, T, generator=g), old_values=0.1 * torch.randn(B, T, generator=g))


def check_filter(results):
    """Each rank rolls out its own groups; gathered in rank order, the filter must see the single-process batch."""
    from filter import select_groups
    from rollout import Trajectory, Turn
    P, N = 8, 4
    g = torch.Generator().manual_seed(3)
    rewards = torch.randint(0, 3, (P, N), generator=g).float() * 0.5  # ties and zero-std groups on purpose
    rewards[2] = 1.0
    mine = dist.my_range(P)
    local = [Trajectory(env="bandit", seed=100 + p, group_id=p,
                        turns=[Turn("", "", [], True, True, float(rewards[p, k]), float(rewards[p, k]), 0, 0, 0)])
             for p in mine for k in range(N)]
    trajs = dist.all_gather_objects(local)
    gathered = torch.tensor([t.reward for t in trajs]).view(P, N)  # as train.py builds it
    keep, stats = select_groups(gathered, keep=0.25)
    ref_keep, ref_stats = select_groups(rewards, keep=0.25)
    assert torch.equal(keep, ref_keep) and stats == ref_stats
    assert [t.group_id for t in trajs] == [p for p in range(P) for _ in range(N)]
    assert len(set(map(tuple, dist.all_gather_objects([stats["kept_groups"]])))) == 1  # every rank agrees
    results["kept_groups"] = stats["kept_groups"]


def check_update(results, name, ucfg_kw, with_critic):
    """One `update` on a fixed batch: DDP over 2 ranks vs the single-process update in this process.

    SGD first: its step is the gradient itself, so it checks the gradient (loss normalisation and DDP's average;
    grad clipping is off so that a wrong scale cannot hide). Then AdamW, the optimizer train.py uses: it divides
    each gradient entry by its own magnitude, so entries that are float noise around 0 (such as the key-projection
    biases, whose exact gradient is 0: softmax ignores a shift shared by all keys) differ by up to a few 1e-4 of
    the step; its bound is looser."""
    from engine.logprobs import TokenLogprobs
    from starpo import UpdateConfig, token_logprobs, update
    adamw = lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3, weight_decay=0.01)  # noqa: E731, train.py's
    for opt_name, make_opt, rel_tol in (("sgd", lambda m: torch.optim.SGD(m.parameters(), lr=0.1), 1e-5),
                                        ("adamw", adamw, 1e-2)):
        policy, critic = tiny_models(seed=0)
        batch = fixed_batch(policy)
        ucfg = UpdateConfig(**ucfg_kw, max_grad_norm=1e6 if opt_name == "sgd" else 1.0)
        single_pol, single_crit = copy.deepcopy(policy), copy.deepcopy(critic)
        start = [p.detach().clone() for p in [*single_pol.parameters(), *single_crit.parameters()]]
        kw = lambda crit: dict(critic=crit, critic_optimizer=make_opt(crit)) if with_critic else {}  # noqa: E731
        single = update(single_pol, make_opt(single_pol), batch, ucfg, generator=torch.Generator().manual_seed(1),
                        **kw(single_crit))
        device = torch.device("cpu")
        ddp_pol, ddp_crit = dist.ddp(TokenLogprobs(policy, token_logprobs), device), dist.ddp(critic, device)
        multi = update(ddp_pol, make_opt(policy), batch, ucfg, generator=torch.Generator().manual_seed(1),
                       shard=(dist.rank(), dist.world_size()), **kw(ddp_crit))
        dist.assert_in_sync(policy, critic)  # bitwise equal on both ranks
        pairs = list(zip([*policy.parameters(), *critic.parameters()],
                         [*single_pol.parameters(), *single_crit.parameters()], start))
        if not with_critic:
            pairs = pairs[:len(list(policy.parameters()))]
        max_abs = max((a - b).abs().max().item() for a, b, _ in pairs)
        max_w = max(b.abs().max().item() for _, b, _ in pairs)
        max_step = max((b - s).abs().max().item() for _, b, s in pairs)
        assert max_step > 1e-4, "the update should move the weights"
        assert max_abs <= 1e-8 + rel_tol * max_step, (name, opt_name, max_abs, max_step)
        assert multi.keys() == single.keys()
        for k in single:
            assert multi[k] == pytest.approx(single[k], rel=1e-4, abs=1e-6), (name, k, multi[k], single[k])
        results[f"{name}/{opt_name}"] = dict(
            max_abs_diff=max_abs, max_rel_diff_to_weight=max_abs / max_w, max_rel_diff_to_update=max_abs / max_step,
            max_abs_update=max_step, optimizer_steps=single["train/optimizer_steps"])


def live_threads() -> int | None:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else None  # Linux only


def worker(rank: int, port: int, out: str):
    os.environ.update(ENV, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    threads = live_threads()
    dist.init(torch.device("cpu"))
    results = {}
    try:
        check_filter(results)
        # rows: 7 -> mini-batches of 3, 3, 1; micro 1 gives no_sync accumulation, the 1-row one a zero-weight rank
        check_update(results, "grpo_micro1", dict(mini_batch=3, micro_batch=1, kl_coef=0.01), with_critic=False)
        check_update(results, "ppo_micro2_seqmean", dict(mini_batch=4, micro_batch=2, agg="seq-mean-token-mean"),
                     with_critic=True)
        # rows split unevenly, and a rank with none
        for n in (5, 1):
            x = torch.arange(n * 3.0).view(n, 3)
            r = dist.my_range(n)
            assert torch.equal(dist.gather_rows(x[r.start:r.stop], n), x)
        # drift is caught; DDP around the bare model is refused (it would never all-reduce the fused path)
        policy, _ = tiny_models(seed=0)
        with torch.no_grad():
            next(policy.parameters())[0, 0] += rank
        with pytest.raises(RuntimeError, match="weights differ"):
            dist.assert_in_sync(policy)
        from starpo import token_logprobs
        ids = torch.ones(1, 4, dtype=torch.long)
        with pytest.raises(ValueError, match="TokenLogprobs"):
            token_logprobs(dist.ddp(policy, torch.device("cpu")), ids, ids)
        # train.py: P must split into whole groups per rank
        import train
        err = io.StringIO()
        with redirect_stderr(err), pytest.raises(SystemExit):
            train.main(["--prompts", "3", "--device", "cpu", "--out", str(Path(out) / "never")])
        assert "--prompts 3: must be divisible by the number of processes (2)" in err.getvalue()
        if rank == 0:
            Path(out, "results.json").write_text(json.dumps(results, indent=1))
    finally:
        dist.close()
    # close() freed the process group, DDP wrappers used and all: gloo's worker threads are gone before the
    # interpreter shuts down (distributed.init says why they would otherwise outlive it, and abort the exit)
    assert live_threads() == threads, f"{live_threads()} threads after close(), {threads} before init()"


def test_two_processes_filter_update_and_drift(tmp_path):
    torch.multiprocessing.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    res = json.loads((tmp_path / "results.json").read_text())
    print(json.dumps(res, indent=1))  # the equivalence figures (pytest -s shows them)
    assert res["grpo_micro1/sgd"]["optimizer_steps"] == 3 and res["ppo_micro2_seqmean/adamw"]["optimizer_steps"] == 2


# ------------------------------------------------------------------------------------------- torchrun train.py

def torchrun(args, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--local-addr", "127.0.0.1", "--master-port", str(free_port()),
           "--monitor-interval", "0.1", str(ROOT / "train.py"), *args]
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, **ENV}, timeout=180)
    if p.returncode != 0:
        raise AssertionError(f"{args} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}")
    return p


def rows(path):
    return [json.loads(l) for l in Path(path).read_text().splitlines() if l.strip()]


def test_torchrun_train_same_weights_on_both_ranks_and_resume(bandit_tiny, tmp_path):
    from engine.models import load_critic, load_policy
    from starpo import Critic
    # PPO (a DDP critic too), a 1-turn window (several rows per trajectory, uneven shares), mini-batches of 5
    # --device cpu: gloo, as the file says; on a one-GPU machine two NCCL ranks would share (and fail on) cuda:0
    common = ["--env", "bandit", "--no-think", "--model", bandit_tiny, "--device", "cpu",
              "--lr", "1e-3", "--critic-lr", "1e-3",
              "--algo", "ppo", "--context-turns", "1", "--prompts", "4", "--rollouts", "4", "--filter", "0.5",
              "--mini-batch", "5", "--micro-batch", "2", "--eval-every", "0", "--eval-prompts", "4",
              "--save-every", "1"]
    a = tmp_path / "a"
    p = torchrun(common + ["--steps", "3", "--out", str(a)], tmp_path)
    ra = rows(a / "metrics.jsonl")
    assert [r["step"] for r in ra] == [1, 2, 3]
    assert sum(r.get("train/optimizer_steps", 0) for r in ra) >= 2, "the run should train"
    line = [l for l in p.stdout.splitlines() if l.startswith("weights identical on all 2 processes")]
    assert line, p.stdout[-2000:]
    # the digest both ranks agreed on is the digest of what rank 0 saved
    saved = dist.weights_digest(load_policy(str(a / "final"))[0],
                                Critic(*load_critic(str(a / "ckpt-000003" / "critic"))))
    assert line[0].endswith(f"(sha256 {saved})")

    # resume from the iteration-2 checkpoint, under torchrun: iteration 3 comes out the same
    b = tmp_path / "b"
    shutil.copytree(a, b, ignore=shutil.ignore_patterns("final"))
    (b / "latest").write_text("ckpt-000002")
    p = torchrun(["--resume", str(b), "--steps", "3"], tmp_path)
    assert "resumed from" in p.stdout and "weights identical on all 2 processes" in p.stdout
    rb = rows(b / "metrics.jsonl")
    assert [r["step"] for r in rb] == [1, 2, 3]
    for x, y in zip(ra[2:], rb[2:]):
        for k, v in x.items():
            if not k.startswith("time/"):
                assert y[k] == pytest.approx(v, rel=1e-6, abs=1e-9), (x["step"], k)
    assert math.isfinite(rb[-1]["train/value_loss"])
