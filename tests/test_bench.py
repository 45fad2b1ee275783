"""bench.py's sections on small sizes: they run end to end and report what they claim.

    python -m pytest -q tests/test_bench.py      (about 20 s on one core)

The figures themselves (speed, memory) belong to `python bench.py SECTION` runs quoted in the docs, never to a
timed test: these only check that each section runs and that its checks hold.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tools import bench  # noqa: E402

torch.set_num_threads(1)


SMALL = ["--device", "cpu", "--layers", "2", "--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate",
         "128", "--vocab", "2000", "--gpu-prompts", "2", "--gpu-rollouts", "4", "--gpu-reply", "24",
         "--gpu-decode-steps", "8", "--gpu-eval-prompts", "2", "--repeats", "1"]


def test_gpu_section_runs_on_a_cpu_with_small_shapes(capsys):
    """`bench.py gpu` with 2 layers and small sizes runs on a CPU: one JSON line per configuration with the keys the
    GPU check reads, the engine's decode step timed, two PPO iterations through train.py in a process of its own,
    the last with a real eval, every reply at the token budget (random weights never close their answer), the
    CUDA-only configurations saying why they skip."""
    res = bench.main(["gpu", *SMALL])["gpu"]["configs"]
    lines = [json.loads(l) for l in capsys.readouterr().out.splitlines() if l.startswith("{")]
    assert lines == json.loads(json.dumps(res))
    keys = {"decode_ms_per_step", "rollout_s", "update_s", "iteration_s", "peak_allocated_gib", "peak_reserved_gib"}
    assert all(keys <= set(r) for r in res) and len(res) == 4
    assert not any("error" in r for r in res), res
    eager, graphs, ppo, capped = res
    assert eager["decode_ms_per_step"] > 0 and eager["rows"] == 8
    assert graphs["skipped"] == capped["skipped"] == "needs CUDA"
    assert ppo["rollout_s"] > 0 and ppo["update_s"] > 0 and ppo["iteration_s"] >= ppo["rollout_s"]
    assert ppo["iterations"] == 2 and ppo["eval_s"] > 0 and ppo["eval_prompts"] == 2
    assert ppo["train_rows"] == 4 and ppo["response_length"] > 0.8 * 24 and 0 < ppo["peak_rss_gib"] < 24


def test_a_failing_gpu_configuration_leaves_its_error_and_the_next_one_runs(capsys, monkeypatch):
    """Review of 73ef042: only OutOfMemoryError was caught, so an exit (cli.fail) or an error inside graph capture
    ended the benchmark. Now the decode configuration exits (as cli.fail does) and the training one fails inside
    train.py (a reply budget beyond the model's positions): both lines carry their error, and every line prints."""
    def exits(*a, **k):
        raise SystemExit(2)
    monkeypatch.setattr(bench, "_decode_ms", exits)
    res = bench.main(["gpu", *SMALL, "--gpu-reply", "40000"])["gpu"]["configs"]
    assert len(res) == 4 and len(capsys.readouterr().out.strip().splitlines()) >= 4
    eager, graphs, ppo, capped = res
    assert eager["error"] == "SystemExit: 2" and eager["decode_ms_per_step"] is None
    assert graphs["skipped"] == capped["skipped"] == "needs CUDA"
    assert ppo["error"].startswith("RuntimeError: train.py exited 2: ") and "--max-new-tokens 40000" in ppo["error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_gpu_section_without_cuda_says_so_at_once():
    """Issue 53.8: `bench.py gpu` on a machine without CUDA ran 10 minutes with no output. Now one line, at once;
    `--device cpu` stays the way to try it on a CPU."""
    import subprocess
    import time
    t0 = time.time()
    out = subprocess.run([sys.executable, "tools/bench.py", "gpu"], capture_output=True, text=True,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 2 and time.time() - t0 < 60
    assert out.stderr.strip().count("\n") == 0 and "no CUDA device" in out.stderr and "--device cpu" in out.stderr


def test_the_gpu_check_script_runs_every_step_a_cpu_can(tmp_path):
    """tools/gpu_check.sh --cpu: the GPU check's steps at toy sizes (the CUDA tests skip, the cap and the full bench
    say why they skip), each logged, a SUMMARY line per step, exit 0; a bad flag is refused before any folder."""
    import os
    import subprocess
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "GPU_CHECK_ROOT": str(tmp_path), "PYTHON": sys.executable}
    out = subprocess.run(["bash", "tools/gpu_check.sh", "--cpu"], capture_output=True, text=True, cwd=root, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    (folder,) = tmp_path.iterdir()
    summary = (folder / "SUMMARY").read_text().splitlines()
    assert [line.split()[0] for line in summary] == ["1-cuda-tests", "2-memory-cap", "3-bench-small", "4-train",
                                                     "4-eval", "5-bench-full"]
    assert "4 configurations, 0 failed" in (folder / "3-bench-small.log").read_text()
    assert (folder / "run" / "final").is_dir()
    bad = subprocess.run(["bash", "tools/gpu_check.sh", "--gpu"], capture_output=True, text=True, cwd=root, env=env)
    assert bad.returncode == 2 and "usage" in bad.stderr and len(list(tmp_path.iterdir())) == 1
