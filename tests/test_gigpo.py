"""extras/gigpo.py (`--algo gigpo`, beyond the paper): verl-agent's GiGPO against a slow loop, its identities,
the turn positions its token advantages use, and train.py running it, naming it and resuming it exactly.

    python -m pytest -q tests/test_gigpo.py
"""
import math
import random
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from advantages import grpo_advantages  # noqa: E402
from extras.gigpo import gigpo_advantages, gigpo_token_advantages, has_signal, step_groups  # noqa: E402
from rollout import Segment, Trajectory, Turn  # noqa: E402
from test_train import read_jsonl, run  # noqa: E402


def slow_gigpo(scores, gids, states, rewards, gamma, w, mode, eps):
    """The obvious loops: every mean and std written out."""
    def norm(x, peers):
        mean = sum(peers) / len(peers)
        if mode == "mean_norm":
            return x - mean
        std = math.sqrt(sum((p - mean) ** 2 for p in peers) / (len(peers) - 1)) if len(peers) > 1 else 1.0
        return (x - mean) / (std + eps)
    B = len(scores)
    episode = []
    for b in range(B):
        peers = [scores[c] for c in range(B) if gids[c] == gids[b]]
        episode.append(norm(scores[b], peers) if len(peers) > 1 else 0.0)

    def ret(b, t):
        return sum(gamma ** (k - t) * rewards[b][k] for k in range(t, len(rewards[b])))
    step = []
    for b in range(B):
        row = []
        for t in range(len(states[b])):
            peers = [ret(c, u) for c in range(B) for u in range(len(states[c]))
                     if gids[c] == gids[b] and states[c][u] == states[b][t]]
            row.append(w * norm(ret(b, t), peers) if len(peers) > 1 else 0.0)
        step.append(row)
    return episode, step


def random_case(rng, groups=3, per=4):
    gids, states, rewards = [], [], []
    for g in range(groups):
        for _ in range(per):
            n = rng.randint(1, 5)  # unequal turn counts
            gids.append(g)
            # few distinct boards, so states repeat within and across trajectories; g-specific ones stay apart
            states.append([rng.choice(["A", "B", "C", f"only-{g}-{rng.random()}"]) for _ in range(n)])
            rewards.append([rng.choice([-0.1, 0.0, 1.0, rng.uniform(-1, 2)]) for _ in range(n)])
    scores = [sum(r) + rng.uniform(-0.5, 0.5) for r in rewards]
    return scores, gids, states, rewards


@pytest.mark.parametrize("mode", ["mean_norm", "mean_std_norm"])
@pytest.mark.parametrize("gamma", [0.95, 0.5, 1.0])
def test_gigpo_equals_a_slow_loop(mode, gamma):
    rng = random.Random(7)
    grouped = 0
    for case in range(20):
        scores, gids, states, rewards = random_case(rng)
        w = rng.choice([1.0, 0.5, 2.0])
        ep, st = gigpo_advantages(torch.tensor(scores), gids, states, rewards, gamma, w, mode)
        ep_ref, st_ref = slow_gigpo(scores, gids, states, rewards, gamma, w, mode, 1e-6)
        assert ep.tolist() == pytest.approx(ep_ref, abs=1e-5)
        assert [len(s) for s in st] == [len(s) for s in states]
        assert [a for s in st for a in s] == pytest.approx([a for s in st_ref for a in s], abs=1e-5)
        grouped += step_groups(gids, states)["grouped_turns"] > 0
    assert grouped == 20  # every case had repeated states, so the step level was exercised


def test_all_step_groups_of_one_give_grpo_and_weight_zero_gives_the_episode_advantage():
    rng = random.Random(3)
    scores, gids, _, rewards = random_case(rng)
    unique = [[f"s{b}-{t}" for t in range(len(r))] for b, r in enumerate(rewards)]
    for mode, std in (("mean_norm", False), ("mean_std_norm", True)):
        ep, st = gigpo_advantages(torch.tensor(scores), gids, unique, rewards, 0.9, 1.0, mode)
        assert torch.allclose(ep, grpo_advantages(torch.tensor(scores), gids, norm_by_std=std))
        assert all(a == 0 for s in st for a in s)
    _, states, _ = random_case(rng)[1:]
    states = [s[:len(r)] + ["A"] * (len(r) - len(s)) for s, r in zip(states, rewards)]
    ep0, st0 = gigpo_advantages(torch.tensor(scores), gids, states, rewards, 0.9, 0.0, "mean_std_norm")
    assert torch.allclose(ep0, grpo_advantages(torch.tensor(scores), gids))
    assert all(a == 0 for s in st0 for a in s)


def test_a_hand_worked_example():
    """Two rollouts of one room meet state "S" at turn 0: one solves it in 2 turns (rewards -0.1, 1), the other in
    3 (-0.1, -0.1, 1). Returns from "S" at gamma 0.5: -0.1 + 0.5 = 0.4 and -0.1 - 0.05 + 0.25 = 0.1: the shorter
    path's first action gets +0.15, the longer's -0.15, though both episodes score about the same."""
    ep, st = gigpo_advantages(torch.tensor([0.9, 0.8]), [0, 0], [["S", "X"], ["S", "Y", "Z"]],
                              [[-0.1, 1.0], [-0.1, -0.1, 1.0]], gamma=0.5)
    assert ep.tolist() == pytest.approx([0.05, -0.05])
    assert st == [pytest.approx([0.15, 0.0]), pytest.approx([-0.15, 0.0, 0.0])]
    with pytest.raises(ValueError, match="mode 'median'"):
        gigpo_advantages(torch.tensor([0.0]), [0], [["S"]], [[0.0]], mode="median")


def _traj(gid, obs, rewards, reply_ends, T):
    t = Trajectory(env="sokoban", seed=0, group_id=gid)
    t.turns = [Turn(obs=o, reply="", actions=[], parsed=True, format_ok=True, env_reward=r, reward=r, valid=1,
                    effective=1, response_tokens=2) for o, r in zip(obs, rewards)]
    return t


def test_token_advantages_follow_the_recorded_turn_positions():
    """Each turn's sampled tokens carry episode_adv + w * step_adv of that turn, from Segment.reply_ends, in one
    segment (the whole conversation) and with a segment per turn (a history window)."""
    cfg = SimpleNamespace(gigpo_gamma=0.5, gigpo_weight=1.0, gigpo_mode="mean_norm")
    a = _traj(0, ["S", "X"], [-0.1, 1.0], None, 12)
    b = _traj(0, ["S", "Y", "Z"], [-0.1, -0.1, 1.0], None, 12)
    # one segment each: prompt 0-2, reply 3-4 (end 4), feedback 5-6, reply 7-8 (end 8), ...
    a.segments = [Segment(list(range(9)), [0, 0, 0, 1, 1, 0, 0, 1, 1], reply_ends=[4, 8])]
    b.segments = [Segment(list(range(12)), [0, 0, 0, 1, 1, 0, 1, 1, 0, 0, 1, 1], reply_ends=[4, 7, 11])]
    rows = [(s, t) for t in (a, b) for s in t.segments]
    from engine.logprobs import pad_segments
    _, _, mask = pad_segments([s for s, _ in rows], 0)
    adv, m = gigpo_token_advantages([a, b], rows, mask, cfg)
    ep, st = gigpo_advantages(torch.tensor([a.reward, b.reward]), [0, 0], [["S", "X"], ["S", "Y", "Z"]],
                              [[-0.1, 1.0], [-0.1, -0.1, 1.0]], 0.5)
    want = torch.zeros(2, 12)
    want[0, 3:5], want[0, 7:9] = ep[0] + st[0][0], ep[0] + st[0][1]
    want[1, 3:5], want[1, 6:8], want[1, 10:12] = ep[1] + st[1][0], ep[1] + st[1][1], ep[1] + st[1][2]
    assert torch.allclose(adv, want)
    assert m == {"rollout/gigpo_group_size": pytest.approx(5 / 4), "rollout/gigpo_grouped_turns": pytest.approx(2 / 5)}
    # a window per turn: a segment each, one reply each
    a.segments = [Segment([0, 1, 2, 3], [0, 0, 1, 1], reply_ends=[3]), Segment([0, 1, 2], [0, 0, 1], reply_ends=[2])]
    rows = [(s, t) for t in (a, b) for s in t.segments]
    _, _, mask = pad_segments([s for s, _ in rows], 0)
    adv, _ = gigpo_token_advantages([a, b], rows, mask, cfg)
    assert adv[0, 2:4].tolist() == pytest.approx([float(ep[0] + st[0][0])] * 2)
    assert adv[1, 2].item() == pytest.approx(float(ep[0] + st[0][1]))
    assert has_signal([a, b], cfg)
    flat = _traj(0, ["S"], [0.0], None, 0), _traj(0, ["T"], [0.0], None, 0)
    assert not has_signal(list(flat), cfg)


def test_train_runs_gigpo_names_it_logs_its_groups_and_resumes_exactly(small_path, tmp_path):
    common = [str(ROOT / "train.py"), "--env", "sokoban", "--algo", "gigpo", "--model", small_path, "--lr", "1e-3",
              "--prompts", "4", "--rollouts", "4", "--filter", "0.5", "--max-new-tokens", "30", "--eval-every", "0",
              "--eval-prompts", "4", "--save-every", "2", "--gigpo-gamma", "0.9"]
    p = run(common + ["--steps", "3", "--out", str(tmp_path / "a")], tmp_path)
    first = p.stdout.splitlines()[0]
    assert "GiGPO" in first and "beyond the paper" in first
    run(common + ["--steps", "2", "--out", str(tmp_path / "b")], tmp_path)
    run([str(ROOT / "train.py"), "--resume", str(tmp_path / "b"), "--steps", "3"], tmp_path)
    a, b = read_jsonl(tmp_path / "a" / "metrics.jsonl"), read_jsonl(tmp_path / "b" / "metrics.jsonl")
    assert [r["step"] for r in b] == [1, 2, 3]
    trained = [r for r in a if "rollout/gigpo_group_size" in r]
    assert trained and all(r["rollout/gigpo_group_size"] >= 1 for r in trained)
    assert all(0 <= r["rollout/gigpo_grouped_turns"] <= 1 for r in trained)
    for ra, rb in zip(a, b):
        for k, v in ra.items():
            if not k.startswith("time/"):
                assert rb[k] == pytest.approx(v, rel=1e-6, abs=1e-9), (ra["step"], k)
