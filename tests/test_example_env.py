"""Adding an environment, worked end to end: the README's example env, registered, warmed up, trained.

    python -m pytest -q tests/test_example_env.py      (about 20 s on one core)

An environment is a small seeded class with the public shape every env in envs.py has (`name`, `actions`,
`instruction`, `reset(seed, sample)`, `step(action)`, `render()`, `expert_action()`, `done`); subclassing
envs._TextEnv gives the guards and the action-word parsing, so a new env writes only what is its own. One line
registers it (`ENVS["corridor"] = CorridorEnv`); then the tiny policy's warm-up, train.py, eval.py and
sft_baseline.py all know it.
"""
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import envs  # noqa: E402
from envs import ENVS, _TextEnv  # noqa: E402


class CorridorEnv(_TextEnv):
    """Walk along a corridor of 7 cells to the goal: the smallest multi-turn task."""
    name = "corridor"
    actions = ["Left", "Right"]
    instruction = ("You are in a corridor. Walk to the goal.\nSymbols: P you, G goal, _ floor\n"
                   "Actions: Left, Right")

    def _start(self, seed: int, noise):                         # reset(seed) checked `seed`; no noise here
        rng = np.random.default_rng(seed)                       # the start: the same for every sample
        self._pos, self._goal = (int(x) for x in rng.choice(7, size=2, replace=False))

    def _render(self) -> str:
        return "".join("P" if i == self._pos else "G" if i == self._goal else "_" for i in range(7))

    def _success(self) -> bool:
        return self._pos == self._goal

    def _apply(self, i: int):                                   # i indexes self.actions
        before = self._pos
        self._pos = min(6, max(0, self._pos + (1 if self.actions[i] == "Right" else -1)))
        self.done = self._success()
        info = {"success": self.done, "action_is_valid": True, "action_is_effective": self._pos != before}
        return self._render(), float(self.done), self.done, info

    def expert_action(self) -> str:
        self._require_live("expert_action()")
        return "Right" if self._goal > self._pos else "Left"


@pytest.fixture()
def corridor(monkeypatch):
    monkeypatch.setitem(ENVS, "corridor", CorridorEnv)          # the one registry line, undone after the test
    return "corridor"


def test_the_example_env_has_the_shape_and_an_expert(corridor):
    env = envs.make_env(corridor)
    obs = env.reset(3)
    assert obs.count("P") == 1 and obs.count("G") == 1 and env.reset(3) == obs
    assert env.step("Jump")[3]["action_is_valid"] is False       # unknown words: invalid, nothing changes
    for _ in range(7):
        _, reward, done, info = env.step(env.expert_action())
        if done:
            break
    assert done and reward == 1.0 and info["success"]


def test_the_example_env_trains_for_a_few_iterations(corridor, tmp_path):
    """A small tiny policy warmed up on the new env, then train.py and eval.py on it."""
    import eval as eval_py
    import train
    from tools.prior import ensure_tiny
    torch.set_num_threads(1)
    model = ensure_tiny(str(tmp_path / "cache"), progress=False, envs=[corridor],
                        warmup=dict(steps=40, episodes_per_env=64),
                        model_cfg=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2))
    out = tmp_path / "run"
    train.main(["--env", corridor, "--no-think", "--model", model, "--steps", "3", "--prompts", "4",
                "--rollouts", "4", "--filter", "1.0", "--eval-every", "0", "--eval-prompts", "8",
                "--out", str(out)])
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and "eval/success" in rows[-1]
    assert any(r["train/skipped_zero_std"] == 0 for r in rows)   # some groups disagreed: GRPO had a signal
    res = eval_py.main(["--env", corridor, "--policy", "expert", "--prompts", "16"])
    assert res[corridor]["success"] == 1.0
