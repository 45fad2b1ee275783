"""bench.py's sections on small sizes: they run end to end and report what they claim.

    python -m pytest -q tests/test_bench.py      (about 20 s on one core)

The figures themselves (speed, memory) belong to `python bench.py SECTION` runs quoted in the docs, never to a
timed test: these only check that each section runs and that its checks hold.
"""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402

torch.set_num_threads(1)


def test_gpu_section_runs_on_a_cpu_with_small_shapes(capsys):
    """`bench.py gpu` with 2 layers and small sizes runs on a CPU: one JSON line per configuration with the keys the
    GPU check reads, the engine's decode step timed, one PPO iteration through train.py with every reply at the
    token budget (random weights never close their answer), the CUDA-only configurations saying why they skip."""
    res = bench.main(["gpu", "--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                      "--intermediate", "128", "--vocab", "2000", "--gpu-prompts", "2", "--gpu-rollouts", "4",
                      "--gpu-reply", "24", "--gpu-decode-steps", "8", "--repeats", "1"])["gpu"]["configs"]
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    assert lines == json.loads(json.dumps(res))
    keys = {"decode_ms_per_step", "rollout_s", "update_s", "iteration_s", "peak_gib"}
    assert all(keys <= set(r) for r in res) and len(res) == 4
    eager, graphs, ppo, capped = res
    assert eager["decode_ms_per_step"] > 0 and eager["rows"] == 8
    assert graphs["skipped"] == capped["skipped"] == "needs CUDA"
    assert ppo["rollout_s"] > 0 and ppo["update_s"] > 0 and ppo["iteration_s"] >= ppo["rollout_s"]
    assert ppo["train_rows"] == 4 and ppo["response_length"] > 0.8 * 24 and 0 < ppo["peak_gib"] < 24


def test_signal_noise_matches_the_pairwise_definition():
    """|E g|^2 is the mean dot product of two different batches' gradients, tr Cov the sample variance, the cosine
    the mean pairwise cosine: bench._signal_noise against loops over the pairs."""
    g = torch.randn(5, 7, generator=torch.Generator().manual_seed(0), dtype=torch.float64) + 1.0  # [K, D]
    pairs = [(i, j) for i in range(5) for j in range(5) if i != j]
    r = bench._signal_noise(g)
    assert abs(r["signal"] - sum(float(g[i] @ g[j]) for i, j in pairs) / len(pairs)) < 1e-9
    mean = g.mean(0)
    assert abs(r["noise"] - sum(float((g[k] - mean) @ (g[k] - mean)) for k in range(5)) / 4) < 1e-9
    cos = sum(float(g[i] @ g[j] / (g[i].norm() * g[j].norm())) for i, j in pairs) / len(pairs)
    assert abs(r["cosine"] - cos) < 1e-9
    assert abs(r["batches_needed"] - r["noise"] / r["signal"]) < 1e-9
    same = bench._signal_noise(torch.ones(3, 4))  # no noise: the signal is the gradient itself
    assert same["noise"] == 0 and same["signal"] == 4 and same["cosine"] == 1


def test_noise_section_takes_one_gradient_per_batch(bandit_tiny):
    """`bench.py noise` builds K batches through train.py's own rollout, filter and prepare_batch and keeps one
    gradient of every trainable parameter per batch, real and with random signs."""
    res = bench.main(["noise", "--device", "cpu", "--noise-batches", "3", "--noise-train-args",
                      f"--env bandit --model {bandit_tiny} --prompts 4 --rollouts 4 --filter 0.5"])["noise"]
    assert res["rows"] == 8                              # 2 of 4 groups of 4 kept, one turn each
    for name in ("real", "random_signs"):
        assert res[name]["noise"] > 0 and abs(res[name]["cosine"]) <= 1
