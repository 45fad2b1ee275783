"""Adding an advantage estimator, worked end to end: REINFORCE with a batch-mean baseline, registered by name
and trained for 2 iterations, without editing train.py (as test_example_env.py adds an environment).

    python -m pytest -q tests/test_example_estimator.py      (about 10 s on one core)

An estimator is one function, `fn(kept, rows, batch, cfg) -> (advantages [B, T], returns [B, T] or None,
metrics)`, and one line that names it: `@register("reinforce")` above it, or `ESTIMATORS["reinforce"] = fn`
(advantages.py). Then `python train.py --algo reinforce` runs it, and the run's first line calls itself
"(modified)": it is no longer the paper's method.
"""
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from advantages import ESTIMATORS, broadcast_to_tokens, register  # noqa: E402


@register(None)  # its attributes: no critic, and a batch without a reward spread teaches it nothing
def reinforce(kept, rows, batch, cfg):
    """REINFORCE with a baseline: each trajectory's reward minus the mean reward of the kept batch, on every
    token it sampled."""
    baseline = torch.tensor([t.reward for t in kept]).mean()  # over trajectories, not rows
    row_adv = torch.tensor([t.reward for _, t in rows]) - baseline  # [B]: a row's trajectory's reward
    advantages = broadcast_to_tokens(row_adv.to(batch.loss_mask.device), batch.loss_mask)  # [B, T]
    return advantages, None, {"train/baseline": baseline.item()}


@pytest.fixture()
def registered(monkeypatch):
    monkeypatch.setitem(ESTIMATORS, "reinforce", reinforce)  # the one table line, undone after the test
    return "reinforce"


def test_the_example_estimator_equals_a_slow_loop():
    from types import SimpleNamespace
    traj = [SimpleNamespace(reward=r, segments=[None] * n) for r, n in ((1.0, 1), (0.0, 2), (2.0, 1))]
    rows = [(s, t) for t in traj for s in t.segments]
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float)
    adv, returns, m = reinforce(traj, rows, SimpleNamespace(loss_mask=mask), None)
    mean = (1.0 + 0.0 + 2.0) / 3
    for b, (_, t) in enumerate(rows):
        for j in range(4):
            assert adv[b, j].item() == pytest.approx((t.reward - mean) * mask[b, j].item())
    assert returns is None and m["train/baseline"] == pytest.approx(mean)


def test_the_example_estimator_trains_through_train_py(registered, bandit_tiny, tmp_path, capsys):
    import train
    torch.set_num_threads(1)
    out = tmp_path / "run"
    train.main(["--env", "bandit", "--algo", registered, "--model", bandit_tiny, "--steps", "2",
                "--prompts", "4", "--rollouts", "4", "--filter", "1.0", "--eval-every", "0",
                "--eval-prompts", "8", "--out", str(out)])
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("StarPO (modified): REINFORCE, all 4 groups"), first
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    trained = [r for r in rows if "train/baseline" in r]
    assert trained and all(r["train/optimizer_steps"] >= 1 for r in trained)
    assert "critic" not in {p.name for p in (out / "ckpt-000002").iterdir()}  # no critic was built
