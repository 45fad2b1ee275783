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
from tools import bench  # noqa: E402

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
