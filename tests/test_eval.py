"""Tests for eval.py: the scripted floor and ceiling, the markdown table, --samples pooling, Wilson intervals.

    python -m pytest -q tests/test_eval.py
"""
import json
import math
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from eval import wilson  # noqa: E402
from test_train import run  # noqa: E402


def test_eval_scripted_floor_and_ceiling_and_table(tmp_path):
    p = run([str(ROOT / "eval.py"), "--envs", "sokoban,frozenlake", "--policy", "expert", "--prompts", "32",
             "--json", str(tmp_path / "x.json")], tmp_path)
    res = json.loads((tmp_path / "x.json").read_text())["results"]
    assert res["sokoban"]["success"] >= 0.95 and res["sokoban"]["valid_action"] == 1.0
    assert "| sokoban |" in p.stdout and "| frozenlake |" in p.stdout
    run([str(ROOT / "eval.py"), "--env", "sokoban", "--policy", "random", "--prompts", "32", "--json",
         str(tmp_path / "r.json")], tmp_path)
    assert json.loads((tmp_path / "r.json").read_text())["results"]["sokoban"]["success"] < 0.5
    bad = run([str(ROOT / "eval.py"), "--envs", "sokoban,chess"], tmp_path, check=False)
    assert bad.returncode == 2 and "chess" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize("policy", ["random", "MODEL"])
def test_eval_samples_pool_one_eval_per_sampling_seed(policy, bandit_tiny, tmp_path, capsys):
    import eval as eval_py
    base = ["--env", "bandit", "--policy", bandit_tiny if policy == "MODEL" else policy, "--prompts", "16"]
    one = [eval_py.main(base + ["--seed", str(s)])["bandit"] for s in (3, 4)]
    assert one[0]["reward"] != one[1]["reward"]  # two sampling seeds, two different evals
    both = eval_py.main(base + ["--seed", "3", "--samples", "2", "--json", str(tmp_path / "x.json")])["bandit"]
    assert both["episodes"] == 32 and both["success_per_sample"] == [m["success"] for m in one]
    assert both["success"] == (one[0]["success"] + one[1]["success"]) / 2
    assert both["reward"] == pytest.approx((one[0]["reward"] + one[1]["reward"]) / 2)
    assert (both["success_lo"], both["success_hi"]) == wilson(round(both["success"] * 32), 32)
    saved = json.loads((tmp_path / "x.json").read_text())["results"]["bandit"]
    assert saved["success_per_sample"] == both["success_per_sample"]
    out = capsys.readouterr()
    assert "per sample:" in out.err and "16 prompts x 2 sample(s)" in out.out


def test_wilson_interval():
    lo, hi = wilson(0, 256)
    assert lo == 0 and 0 < hi < 0.02
    lo, hi = wilson(128, 256)
    assert lo < 0.5 < hi and hi - lo == pytest.approx(2 * 1.96 * math.sqrt(0.25 / 256), rel=0.02)


def test_eval_runs_in_chunks_of_128_rows_on_cuda(monkeypatch):
    """Issue 50: on CUDA the periodic eval decodes at most 128 episodes at once (the engine's rows: a
    256-row KV cache would not fit beside training under a 22.5 GiB cap); a CPU keeps its 256."""
    import eval as eval_py
    assert eval_py.eval_batch(torch.device("cuda")) == 128 and eval_py.eval_batch(torch.device("cpu")) == 256
    sizes = []
    monkeypatch.setattr(eval_py, "rollout", lambda env, seeds, *a, **k: sizes.append(len(seeds)) or [])
    monkeypatch.setattr(eval_py, "summarize", lambda trajs, scripted=False: {})
    monkeypatch.setattr(eval_py, "eval_batch", lambda device, model=None, rcfg=None: 128)
    eval_py.evaluate("bandit", None, agent=object(), prompts=256)
    assert sizes == [128, 128]


def test_a_cpu_eval_batch_keeps_the_kv_cache_under_its_budget(monkeypatch):
    """Issue 65.5: 256 Sokoban episodes of SmolLM2 at 400-token replies, at once, grew the process to 13 GB and
    were killed. A CPU eval halves its batch while the cache it could grow to passes EVAL_KV_BUDGET (12 GiB,
    or a quarter of the machine's memory if less); at 12 GiB the tiny prior and a hub model's short replies
    keep 256."""
    import os
    from types import SimpleNamespace
    import eval as eval_py
    from rollout import RolloutConfig
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert eval_py.EVAL_KV_BUDGET <= min(12 * 2 ** 30, memory / 4)
    monkeypatch.setattr(eval_py, "EVAL_KV_BUDGET", 12 * 2 ** 30)
    smol = SimpleNamespace(num_hidden_layers=30, num_key_value_heads=3, num_attention_heads=9, hidden_size=576,
                           head_dim=64)  # SmolLM2-135M's shape

    class Model:
        def __init__(self, config, dtype):
            self.config, self.weight = config, torch.zeros(1, dtype=dtype)

        def parameters(self):
            yield self.weight

    cpu = torch.device("cpu")
    tiny = Model(SimpleNamespace(num_hidden_layers=4, num_key_value_heads=2, num_attention_heads=4,
                                 hidden_size=128), torch.float32)
    assert eval_py.eval_batch(cpu, tiny, RolloutConfig(max_new_tokens=400)) == 256
    assert eval_py.eval_batch(cpu, Model(smol, torch.bfloat16), RolloutConfig(max_new_tokens=60)) == 256
    for dtype, tokens in ((torch.bfloat16, 400), (torch.float32, 60), (torch.float32, 400)):
        rows = eval_py.eval_batch(cpu, Model(smol, dtype), RolloutConfig(max_new_tokens=tokens))
        per_row = 1.5 * (256 + 5 * (tokens + 128)) * 2 * 30 * 3 * 64 * dtype.itemsize
        assert rows < 256 and rows * per_row <= eval_py.EVAL_KV_BUDGET < 2 * rows * per_row, (dtype, tokens)
    assert eval_py.eval_batch(torch.device("cuda"), Model(smol, torch.bfloat16), RolloutConfig()) == 128


@pytest.mark.parametrize("n", [1, 2, 3, 4, 6, 8])
def test_pass_at_k_equals_brute_force_enumeration(n):
    """The unbiased pass@k against counting every k-subset of a prompt's n samples."""
    import itertools
    from eval import pass_at_k
    g = torch.Generator().manual_seed(n)
    outcomes = [[int(x) for x in torch.randint(0, 2, (n,), generator=g)] for _ in range(5)] + [[0] * n, [1] * n]
    for k in range(1, n + 1):
        brute = []
        for samples in outcomes:
            subsets = list(itertools.combinations(samples, k))
            brute.append(sum(any(s) for s in subsets) / len(subsets))
        assert pass_at_k([sum(s) for s in outcomes], n, k) == pytest.approx(sum(brute) / len(brute))


def test_eval_reports_pass_at_k_for_powers_of_two(tmp_path):
    out = tmp_path / "e.json"
    import eval as eval_py
    eval_py.main(["--env", "bandit", "--policy", "random", "--prompts", "8", "--samples", "6", "--json", str(out)])
    res = json.loads(out.read_text())["results"]["bandit"]
    assert list(res["pass_at_k"]) == ["1", "2", "4"]
    assert res["pass_at_k"]["1"] == pytest.approx(res["success"])
    assert res["pass_at_k"]["1"] <= res["pass_at_k"]["2"] <= res["pass_at_k"]["4"] <= 1
