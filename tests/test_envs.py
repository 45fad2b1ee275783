"""Tests for envs.py: public shape, determinism, generators, rules and experts of every environment.

Run from the repository root:  python -m pytest -q tests/test_envs.py   (about 10 s on one core)

The Sokoban and FrozenLake checks re-derive everything from the observation text with this file's own
parser, rule simulator, breadth-first search and value iteration, so they do not trust envs.py internals.
"""
import copy
import math
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import envs  # noqa: E402

ALL = ["bandit", "bandit-rev", "bandit-test", "sokoban", "sokoban-newvocab", "sokoban-large", "frozenlake"]
SOKOBAN = {  # name -> (size, boxes, legend: wall, empty, target, box, box on target, player, player on target)
    "sokoban": (6, 1, "#_OX√PS"),
    "sokoban-newvocab": (6, 1, "W.GBCA@"),
    "sokoban-large": (8, 2, "#_OX√PS"),
}
UDLR = {"Up": (-1, 0), "Down": (1, 0), "Left": (0, -1), "Right": (0, 1)}
LAKE = {"Left": (0, -1), "Down": (1, 0), "Right": (0, 1), "Up": (-1, 0)}
BAD_WORDS = ["", "   ", "jump", "Up Up", "upp", "Left;", None, 3, "<answer>Up</answer>"]


# ----------------------------------------------------------------------------- independent helpers

def parse_sokoban(obs, legend):
    """(walls, targets, boxes, player, shape) from grid text, using only the published legend."""
    wall, empty, target, box, box_t, player, player_t = legend
    rows = obs.split("\n")
    walls, targets, boxes, players = set(), set(), set(), []
    for r, row in enumerate(rows):
        for c, ch in enumerate(row):
            assert ch in legend, f"unknown symbol {ch!r} in\n{obs}"
            if ch == wall:
                walls.add((r, c))
            if ch in (target, box_t, player_t):
                targets.add((r, c))
            if ch in (box, box_t):
                boxes.add((r, c))
            if ch in (player, player_t):
                players.append((r, c))
    assert len(players) == 1, obs
    return walls, targets, frozenset(boxes), players[0], (len(rows), len(rows[0]))


def draw_sokoban(walls, targets, boxes, player, shape, legend):
    wall, empty, target, box, box_t, pl, pl_t = legend
    out = []
    for r in range(shape[0]):
        row = ""
        for c in range(shape[1]):
            q, on = (r, c), (r, c) in targets
            row += wall if q in walls else (pl_t if on else pl) if q == player else \
                (box_t if on else box) if q in boxes else (target if on else empty)
        out.append(row)
    return "\n".join(out)


def push_rule(walls, boxes, player, d):
    """Reference Sokoban rule: walk, or push one box one cell; never into a wall or another box."""
    q = (player[0] + d[0], player[1] + d[1])
    if q in walls:
        return player, boxes, "wall"
    if q in boxes:
        b = (q[0] + d[0], q[1] + d[1])
        if b in walls:
            return player, boxes, "box-wall"
        if b in boxes:
            return player, boxes, "box-box"
        return q, (boxes - {q}) | {b}, "push"
    return q, boxes, "walk"


def reference_bfs(walls, targets, boxes, player):
    """Fewest moves to cover every target, by a plain BFS over (player, boxes)."""
    start = (player, boxes)
    dist = {start: 0}
    todo = deque([start])
    while todo:
        p, bx = todo.popleft()
        if bx <= targets:
            return dist[(p, bx)]
        for d in UDLR.values():
            q, nb, _ = push_rule(walls, bx, p, d)
            if (q, nb) not in dist:
                dist[(q, nb)] = dist[(p, bx)] + 1
                todo.append((q, nb))
    return None


def parse_lake(obs):
    rows = obs.split("\n")
    board, player = [], None
    for r, row in enumerate(rows):
        line = ""
        for c, ch in enumerate(row):
            assert ch in "P_OGX√", f"unknown symbol {ch!r} in\n{obs}"
            if ch in "PX√":
                assert player is None, obs
                player = (r, c)
            line += {"P": "F", "_": "F", "O": "H", "G": "G", "X": "H", "√": "G"}[ch]
        board.append(line)
    return board, player


def lake_moves(board, cell, d):
    n = len(board)
    r, c = cell[0] + d[0], cell[1] + d[1]
    return (r, c) if 0 <= r < n and 0 <= c < n else cell


def lake_transitions(board, slippery=True):
    """{(cell, action word): [(prob, next cell)]}; action order Left, Down, Right, Up (perpendiculars adjacent)."""
    words = list(LAKE)
    n, T = len(board), {}
    for r in range(n):
        for c in range(n):
            for i, w in enumerate(words):
                dirs = [words[(i - 1) % 4], w, words[(i + 1) % 4]] if slippery else [w]
                T[((r, c), w)] = [(1 / len(dirs), lake_moves(board, (r, c), LAKE[x])) for x in dirs]
    return T


def lake_max_success(board, T):
    """Maximal probability of ever reaching G per cell [n*n], by value iteration from below."""
    n = len(board)
    idx = {(r, c): r * n + c for r in range(n) for c in range(n)}
    P = np.zeros((n * n, 4, n * n))  # [S, 4, S], zero rows for holes and the goal
    for (q, w), outcomes in T.items():
        if board[q[0]][q[1]] == "F":
            for p, s in outcomes:
                P[idx[q], list(LAKE).index(w), idx[s]] += p
    goal = np.array([float(board[r][c] == "G") for r in range(n) for c in range(n)])
    V = goal.copy()
    for _ in range(100_000):
        V_new = np.maximum(goal, (P @ V).max(axis=1))
        if np.abs(V_new - V).max() < 1e-13:  # from below; the error left is far under 1e-6
            return V_new
        V = V_new
    return V


def lake_policy_success(board, T, policy):
    """Success probability of a stationary policy {cell: word}: x = goal + P_pi x iterated from 0
    (the least fixed point, so a policy that loops forever without reaching G scores 0 there)."""
    n = len(board)
    idx = {(r, c): r * n + c for r in range(n) for c in range(n)}
    P, goal = np.zeros((n * n, n * n)), np.zeros(n * n)
    for q, i in idx.items():
        tile = board[q[0]][q[1]]
        if tile == "G":
            goal[i] = 1.0
        elif tile == "F":
            for p, s in T[(q, policy[q])]:
                P[i, idx[s]] += p
    x = np.zeros(n * n)
    for _ in range(100_000):
        x_new = goal + P @ x
        if np.abs(x_new - x).max() < 1e-13:
            return x_new
        x = x_new
    return x


def lake_shortest(board, start):
    dist, todo = {start: 0}, deque([start])
    while todo:
        q = todo.popleft()
        if board[q[0]][q[1]] == "G":
            return dist[q]
        if board[q[0]][q[1]] == "H":
            continue
        for d in LAKE.values():
            s = lake_moves(board, q, d)
            if s not in dist:
                dist[s] = dist[q] + 1
                todo.append(s)
    return None


# ----------------------------------------------------------------------------- API, registry, errors

def test_bandit_test_is_ragens_held_out_pair_of_names():
    env = envs.make_env("bandit-test")
    assert (env.safe_name, env.risky_name) == ("Trader", "Librarian") and env.actions == ["Librarian", "Trader"]
    env.reset(3)
    assert env.expert_action() == "Librarian" and env.step("Trader")[1] == envs.BanditEnv.SAFE_PAYOFF


def test_registry_seeds_and_make_env_errors():
    assert sorted(envs.ENVS) == sorted(ALL + ["webshop"])  # webshop is tested in test_webshop.py
    assert envs.EVAL_SEEDS == list(range(123, 379)) and len(envs.EVAL_SEEDS) == 256
    with pytest.raises(ValueError) as err:
        envs.make_env("sokobann")
    assert all(n in str(err.value) for n in ALL)
    cases = [
        ("sokoban", {"colour": 1}, "colour"), ("frozenlake", {"slipery": False}, "slipery"),
        ("bandit", {"arm": "X"}, "arm"), ("sokoban", {"size": 100}, "size"),
        ("sokoban-large", {"num_boxes": 0}, "num_boxes"), ("sokoban", {"search_depth": "deep"}, "search_depth"),
        ("sokoban", {"size": True}, "size"), ("frozenlake", {"slippery": "yes"}, "slippery"),
        ("frozenlake", {"p": 0.1}, "p"), ("frozenlake", {"size": 1}, "size"),
        ("bandit", {"safe_name": "Red Dragon"}, "safe_name"), ("bandit-rev", {"risky_name": ""}, "risky_name"),
        ("bandit", {"safe_name": "dragon"}, "differ"),
    ]
    for name, kw, word in cases:
        with pytest.raises(ValueError) as err:
            envs.make_env(name, **kw)
        assert word in str(err.value), (name, kw, str(err.value))
    assert envs.make_env("frozenlake", slippery=False, size=5).reset(0).count("\n") == 4
    assert envs.make_env("sokoban", size=7).reset(0).count("\n") == 6
    assert set(envs.make_env("bandit", safe_name="Owl", risky_name="Tiger").actions) == {"Owl", "Tiger"}


def test_train_seeds():
    a = envs.train_seeds(7, 500)
    assert a == envs.train_seeds(7, 500) and a != envs.train_seeds(8, 500)
    assert len(set(a)) == 500 and all(isinstance(s, int) and 1000 <= s < 2**31 for s in a)
    assert not set(a) & set(envs.EVAL_SEEDS)
    assert len(envs.train_seeds(np.random.default_rng(0), 3)) == 3 and envs.train_seeds(1, 0) == []


@pytest.mark.parametrize("name", ALL)
def test_public_shape_and_guards(name):
    env = envs.make_env(name)
    assert env.name == name and env.done is False
    assert env.actions and all(isinstance(a, str) and a.isalpha() for a in env.actions)
    assert all(a in env.instruction for a in env.actions)
    assert all(ch.isascii() or ch == "√" for ch in env.instruction)
    for call in (env.render, env.expert_action, lambda: env.step(env.actions[0])):
        with pytest.raises(RuntimeError):
            call()
    with pytest.raises(ValueError):
        env.reset(-1)
    with pytest.raises(ValueError):
        env.reset("3")
    obs = env.reset(5)
    assert isinstance(obs, str) and obs == env.render()
    if not name.startswith("bandit"):
        assert " " not in obs and len(set(map(len, obs.split("\n")))) == 1  # a grid, no spaces
    assert all(ch.isascii() or ch == "√" for ch in obs)
    assert env.expert_action() in env.actions
    obs, reward, done, info = env.step(env.expert_action())
    assert isinstance(obs, str) and isinstance(reward, float) and isinstance(done, bool)
    assert {"success", "action_is_valid", "action_is_effective"} <= set(info) and info["action_is_valid"]


@pytest.mark.parametrize("name", ALL)
def test_determinism_per_seed(name):
    words = envs.make_env(name).actions + ["bogus"]
    for seed in [0, 123, 378, 99991]:
        runs = []
        for _ in range(2):
            env, rng = envs.make_env(name), np.random.default_rng(seed)
            trace = [env.reset(seed)]
            while not env.done and len(trace) < 40:
                trace.append(env.step(words[rng.integers(len(words))]))
            runs.append(trace)
        assert runs[0] == runs[1]
    if name.startswith(("sokoban", "frozenlake")):
        env = envs.make_env(name)
        assert len({env.reset(s) for s in envs.EVAL_SEEDS}) > 100  # seeds really pick different rooms


@pytest.mark.parametrize("name", ALL)
def test_invalid_words_never_raise_and_change_nothing(name):
    env = envs.make_env(name)
    obs = env.reset(11)
    for word in BAD_WORDS + ([] if name.startswith("bandit") else ["Dragon"]):
        out, reward, done, info = env.step(word)
        assert (out, reward, done) == (obs, 0.0, False) and env.done is False
        assert info["action_is_valid"] is False and info["action_is_effective"] is False
        assert info["success"] is False
    mixed = "  " + "".join(ch.upper() if i % 2 else ch.lower() for i, ch in enumerate(env.actions[0])) + " "
    assert env.step(mixed)[3]["action_is_valid"] is True


@pytest.mark.parametrize("name", ALL)
def test_stepping_a_finished_episode_raises(name):
    env = envs.make_env(name)
    env.reset(200)
    for _ in range(500):
        if env.done:
            break
        env.step(env.expert_action())
    assert env.done
    with pytest.raises(RuntimeError, match="reset"):
        env.step(env.actions[0])
    with pytest.raises(RuntimeError):
        env.step("bogus")
    env.reset(200)
    assert env.done is False


# ----------------------------------------------------------------------------- Sokoban

@pytest.mark.parametrize("name", list(SOKOBAN))
def test_sokoban_eval_rooms_valid_solvable_and_expert_is_bfs_optimal(name):
    size, nbox, legend = SOKOBAN[name]
    env = envs.make_env(name)
    lengths = []
    for seed in envs.EVAL_SEEDS:
        obs = env.reset(seed)
        walls, targets, boxes, player, shape = parse_sokoban(obs, legend)
        assert shape == (size, size) and all(len(r) == size for r in obs.split("\n"))
        border = {(r, c) for r in range(size) for c in range(size) if r in (0, size - 1) or c in (0, size - 1)}
        assert border <= walls and len(boxes) == len(targets) == nbox
        assert not boxes & targets  # reverse play leaves every box off its target
        best = reference_bfs(walls, targets, boxes, player)
        assert best is not None and best >= 1, f"{name} seed {seed} unsolvable:\n{obs}"
        steps = 0
        while not env.done:
            assert steps < best, f"{name} seed {seed}: expert longer than BFS ({best})"
            obs, reward, done, info = env.step(env.expert_action())
            assert info["action_is_effective"]
            steps += 1
        assert steps == best and info["success"] and reward >= 10.0
        lengths.append(best)
    assert len(lengths) == 256 and max(lengths) >= 2


@pytest.mark.parametrize("name", list(SOKOBAN))
def test_sokoban_rules_against_reference_simulator(name):
    """Random play checked step by step: walk, push, no pulls, blocked pushes, rewards, effectiveness."""
    size, nbox, legend = SOKOBAN[name]
    env, rng = envs.make_env(name), np.random.default_rng(1)
    seen = {"wall": 0, "box-wall": 0, "box-box": 0, "push": 0, "walk": 0}
    for seed in envs.EVAL_SEEDS:
        obs = env.reset(seed)
        for _ in range(30):
            walls, targets, boxes, player, shape = parse_sokoban(obs, legend)
            word = env.actions[rng.integers(4)]
            p2, b2, kind = push_rule(walls, boxes, player, UDLR[word])
            seen[kind] += 1
            obs, reward, done, info = env.step(word)
            assert obs == draw_sokoban(walls, targets, b2, p2, shape, legend), (name, seed, word, kind)
            solved = b2 <= targets
            want = -0.1 + (len(b2 & targets) > len(boxes & targets)) - (len(b2 & targets) < len(boxes & targets))
            assert math.isclose(reward, want + 10.0 * solved)
            assert info["action_is_effective"] == (p2 != player) and done == solved == info["success"]
            if done:
                break
    assert seen["wall"] and seen["box-wall"] and seen["push"] and seen["walk"], seen
    if nbox > 1:
        assert seen["box-box"], seen


def test_sokoban_newvocab_is_sokoban_with_other_symbols():
    env = envs.make_env("sokoban-newvocab")
    obs = env.reset(4)
    assert set(obs) <= set("W.GBCA@\n") and "#" not in env.instruction
    for sym, word in zip("W.GBCA@", ["wall", "empty", "target", "box", "box on target", "player", "player on target"]):
        assert f"{sym} {word}" in env.instruction


def test_sokoban_expert_plan_is_cached_and_dead_ends_do_not_raise(monkeypatch):
    calls = []
    real_bfs = envs.sokoban_bfs
    monkeypatch.setattr(envs, "sokoban_bfs", lambda *a: calls.append(1) or real_bfs(*a))
    env = envs.make_env("sokoban-large")
    for seed in envs.EVAL_SEEDS[:20]:
        env.reset(seed)
        calls.clear()
        while not env.done:
            assert env.expert_action() == env.expert_action()
            env.step(env.expert_action())
        assert len(calls) == 1, (seed, len(calls))  # one search per room while the plan is followed
    # A stuck box: no plan exists; the expert still answers with an action word.
    size, nbox, legend = SOKOBAN["sokoban"]
    env, rng, stuck = envs.make_env("sokoban"), np.random.default_rng(3), 0
    for seed in envs.EVAL_SEEDS:
        obs = env.reset(seed)
        for _ in range(20):
            obs, _, done, _ = env.step(env.actions[rng.integers(4)])
            if done:
                break
            walls, targets, boxes, player, _ = parse_sokoban(obs, legend)
            if reference_bfs(walls, targets, boxes, player) is None:
                assert env.expert_action() == env.actions[0]
                stuck += 1
                break
    assert stuck > 10


@pytest.mark.parametrize("name", sorted(SOKOBAN))
def test_sokoban_expert_note_matches_the_grid_and_the_expert(name):
    """The expert's scratchpad (envs.py deviation 9) names exactly the cells the grid shows, counted from 1, and
    then the next push that the expert's own moves make: its direction, the cell the player pushes from and,
    with several boxes, which box. Checked against the grid alone: parse, then replay the expert on the text."""
    size, nbox, legend = SOKOBAN[name]
    env, rng = envs.make_env(name), np.random.default_rng(0)
    pushes = 0
    for seed in envs.EVAL_SEEDS[:30]:
        obs = env.reset(seed)
        for _ in range(4):  # the start and a few random states, boxes on targets included
            walls, targets, boxes, player, _ = parse_sokoban(obs, legend)
            where, _, push = env.expert_note().partition(". ")
            parts = [p.split() for p in where.split(", ")]
            cells = {(w, (int(r) - 1, int(c) - 1)) for w, at, r, c in parts}
            assert all(at == "at" for _, at, _, _ in parts) and len(cells) == len(parts)
            assert cells == ({("player", player)} | {("box", b) for b in boxes}
                             | {("target", t) for t in targets}), (obs, env.expert_note())
            if reference_bfs(walls, targets, boxes, player) is None:  # no plan, so no push to name
                assert push == "", env.expert_note()
            else:
                words = push.split()
                assert words[:3] == ["I", "push", "the"] and words[-4:-2] == ["go", "to"], env.expert_note()
                stand = (int(words[-2]) - 1, int(words[-1]) - 1)
                which = (int(words[5]) - 1, int(words[6]) - 1) if nbox > 1 else next(iter(boxes))
                direction = words[-6].rstrip(":")
                # replay the expert on a copy until its first push: from `stand`, in `direction`, moving `which`
                sim, p, bx = copy.deepcopy(env), player, boxes
                while True:
                    a = sim.expert_action()
                    q = (p[0] + UDLR[a][0], p[1] + UDLR[a][1])
                    if q in bx:
                        assert (p, a, q) == (stand, direction, which), (obs, env.expert_note())
                        break
                    o, _, _, _ = sim.step(a)
                    _, _, bx, p, _ = parse_sokoban(o, legend)
                pushes += 1
            obs, _, done, _ = env.step(env.actions[rng.integers(4)])
            if done:
                break
    assert pushes > 50


# ----------------------------------------------------------------------------- FrozenLake

def test_frozenlake_eval_maps_valid_reachable_and_expert_optimal():
    env = envs.make_env("frozenlake")
    for seed in envs.EVAL_SEEDS:
        obs = env.reset(seed)
        board, start = parse_lake(obs)
        assert len(board) == 4 and all(len(r) == 4 for r in board) and obs.count("P") == 1
        assert sum(r.count("G") for r in board) == 1 and board[start[0]][start[1]] == "F"
        assert lake_shortest(board, start) is not None, f"seed {seed}: goal unreachable\n{obs}"
        T = lake_transitions(board)
        best = lake_max_success(board, T)
        policy_arr = envs.lake_policy(np.array([list(r) for r in board]), True)
        policy = {(r, c): env.actions[policy_arr[r * 4 + c]] for r in range(4) for c in range(4)}
        assert env.expert_action() == policy[start]
        achieved = lake_policy_success(board, T, policy)
        assert np.abs(achieved - best).max() < 1e-6, (seed, achieved, best)


def test_frozenlake_deterministic_expert_takes_a_shortest_path():
    env = envs.make_env("frozenlake", slippery=False)
    assert "slippery" not in env.instruction
    for seed in envs.EVAL_SEEDS:
        board, start = parse_lake(env.reset(seed))
        need, steps = lake_shortest(board, start), 0
        while not env.done:
            obs, reward, done, info = env.step(env.expert_action())
            steps += 1
        assert steps == need and info["success"] and reward == 1.0


def test_frozenlake_slips_are_one_third_each_and_never_backwards():
    env, rng = envs.make_env("frozenlake"), np.random.default_rng(0)
    words = env.actions
    counts = {"intended": 0, "left_of": 0, "right_of": 0, "backwards": 0}
    for seed in range(3000):
        obs = env.reset(seed)
        while not env.done:
            board, here = parse_lake(obs)
            i = int(rng.integers(4))
            obs, reward, done, info = env.step(words[i])
            _, there = parse_lake(obs)
            delta = (there[0] - here[0], there[1] - here[1])
            options = {LAKE[words[(i + k) % 4]]: name for k, name in
                       [(0, "intended"), (-1, "left_of"), (1, "right_of"), (2, "backwards")]}
            if delta == (0, 0):  # only possible when the drawn direction hits the border
                assert any(lake_moves(board, here, LAKE[words[(i + k) % 4]]) == here for k in (-1, 0, 1))
                continue
            kind = options[delta]
            assert kind != "backwards", (seed, here, words[i], obs)
            if 1 <= here[0] <= 2 and 1 <= here[1] <= 2:  # interior: no border can hide a slip
                counts[kind] += 1
            assert reward == float(board[there[0]][there[1]] == "G") and done == (board[there[0]][there[1]] in "HG")
    n = sum(counts.values())
    assert n > 3000 and counts["backwards"] == 0
    for kind in ("intended", "left_of", "right_of"):
        assert abs(counts[kind] / n - 1 / 3) < 5 * math.sqrt(2 / 9 / n), counts
    env = envs.make_env("frozenlake", slippery=False)
    for seed in range(300):
        obs = env.reset(seed)
        while not env.done:
            board, here = parse_lake(obs)
            w = words[int(rng.integers(4))]
            obs = env.step(w)[0]
            assert parse_lake(obs)[1] == lake_moves(board, here, LAKE[w])


# ----------------------------------------------------------------------------- Bandit

@pytest.mark.parametrize("name,safe,risky", [("bandit", "Phoenix", "Dragon"), ("bandit-rev", "Dragon", "Phoenix")])
def test_bandit_payoffs_order_and_success(name, safe, risky):
    env = envs.make_env(name)
    assert env.actions == ["Dragon", "Phoenix"]  # identical prompt for both variants
    first_listed, risky_pay = [], []
    for seed in range(4000):
        obs = env.reset(seed)
        assert obs.startswith("Arms: ") and {safe, risky} == set(obs[6:].split(", "))
        first_listed.append(obs[6:].split(", ")[0] == risky)
        assert env.expert_action() == risky
        arm = risky if seed % 2 else safe
        out, reward, done, info = env.step(arm)
        assert done and env.done and info["action_is_valid"] and info["success"] == (arm == risky)
        assert out == f"{arm}: {reward:g} points"
        if arm == safe:
            assert reward == 0.15
        else:
            assert reward in (0.0, 1.0)
            risky_pay.append(reward)
    n = len(risky_pay)
    assert abs(np.mean(risky_pay) - 0.25) < 5 * math.sqrt(0.25 * 0.75 / n)
    assert abs(np.mean(first_listed) - 0.5) < 5 * math.sqrt(0.25 / 4000)
    env.reset(1)
    assert env.step("nothing")[1:3] == (0.0, False) and env.step(risky.upper())[2] is True


def test_rollouts_of_one_prompt_share_the_start_and_the_sample_decides_the_luck():
    """reset(seed, sample): same initial state for every sample; the same sample gives the same payoffs and
    slips (train.py --group-noise shared, RAGEN's seeding), other samples independent ones."""
    for name in ("bandit", "frozenlake"):
        runs = []
        for _ in range(2):
            env = envs.make_env(name)
            env.reset(11, sample=0)
            runs.append([env.step(env.actions[1])[:3] for _ in range(1 if name == "bandit" else 3) if not env.done])
        assert runs[0] == runs[1]
    for name in ALL:
        a, b = envs.make_env(name), envs.make_env(name)
        assert a.reset(7, sample=0) == b.reset(7, sample=3)
        assert a.reset(7, sample=2) == b.reset(7, sample=2)
        with pytest.raises(ValueError):
            a.reset(7, sample=-1)
    # Bandit: the risky payoff of one prompt over 2000 samples has the definition's mean, not 0 or 1.
    env = envs.make_env("bandit")
    pays = []
    for k in range(2000):
        env.reset(5, sample=k)
        pays.append(env.step("Dragon")[1])
    assert abs(np.mean(pays) - 0.25) < 0.04
    # FrozenLake: one prompt, one action, many samples -> several different outcomes.
    env = envs.make_env("frozenlake")
    outcomes = set()
    for k in range(50):
        env.reset(5, sample=k)
        outcomes.add(env.step("Down")[0])
    assert len(outcomes) >= 2
