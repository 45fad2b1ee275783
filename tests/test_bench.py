"""bench.py's sections on small sizes: they run end to end and report what they claim.

    python -m pytest -q tests/test_bench.py      (about 20 s on one core)

The figures themselves (speed, memory) belong to `python bench.py SECTION` runs quoted in the docs, never to a
timed test: these only check that each section runs and that its checks hold.
"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench  # noqa: E402

torch.set_num_threads(1)


def test_gpu_section_runs_ppo_with_a_critic_on_a_small_qwen_shape():
    """`bench.py gpu` with 2 layers and small sizes runs on a CPU: two PPO iterations through train.py, every
    reply at the token budget (random weights never close their answer), an update that trains rows."""
    res = bench.main(["gpu", "--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
                      "--intermediate", "128", "--vocab", "2000", "--gpu-prompts", "2", "--gpu-rollouts", "4",
                      "--gpu-reply", "24", "--gpu-iterations", "2"])["gpu"]
    assert len(res["phases"]["rollout"]) == 2 and all(t > 0 for t in res["phases"]["update"])
    assert res["rows"] == [4, 4]                       # filter 0.25 keeps 1 of 2 groups of 4 (zero spread: PPO trains)
    assert all(n > 0.8 * 24 for n in res["response_length"])
    assert res["fits_24gb"] and 0 < res["peak_gib"] < 24
