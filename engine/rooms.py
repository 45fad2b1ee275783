"""Room and map generators of the paper's environments (RAGEN's, after gym-sokoban and gymnasium),
FrozenLake's expert, and the checks of the envs' options: envs.py's Sokoban and FrozenLake draw their initial
states here. A reader may skip it.

Sokoban (gym-sokoban's generate_room, as RAGEN calls it): a random-walk floor plan, targets and a player
placed at random, then reverse play (the player walks and pulls the box behind it, a depth-limited DFS, each
state expanded once) keeps the state that scores best by box swaps x box displacement (0 where a target is
covered), then 0-3 random player moves. One numpy Generator per reset (RAGEN: the global RNGs): the same
algorithm and distribution, other rooms per seed. FrozenLake: RAGEN's generate_random_map (frozen with
probability p, regenerated until a path avoids the holes); its maps equal RAGEN's on all 256 eval seeds.
"""
from __future__ import annotations

import numpy as np

DIRS = ((-1, 0), (1, 0), (0, -1), (0, 1))  # Up, Down, Left, Right (gym-sokoban's order)
MASKS = (  # gym-sokoban's random-walk stamps: 1 = floor, centred on the walker
    ((0, 0, 0), (1, 1, 1), (0, 0, 0)),
    ((0, 1, 0), (0, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (1, 1, 0)),
    ((0, 0, 0), (0, 1, 1), (0, 1, 0)),
)


def _room_topology(rng: np.random.Generator, size: int) -> np.ndarray:
    """Random-walk floor plan, [size, size] with 1 = floor; the border is always wall."""
    level = np.zeros((size, size), dtype=np.int64)
    direction = DIRS[rng.integers(4)]
    pos = [int(rng.integers(1, size)), int(rng.integers(1, size))]
    for _ in range(int(1.7 * (size + size))):
        if rng.random() < 0.35:
            direction = DIRS[rng.integers(4)]
        pos = [min(max(pos[0] + direction[0], 1), size - 2), min(max(pos[1] + direction[1], 1), size - 2)]
        level[pos[0] - 1:pos[0] + 2, pos[1] - 1:pos[1] + 2] += np.array(MASKS[rng.integers(len(MASKS))])
    level = (level > 0).astype(np.int64)
    level[[0, size - 1], :] = 0
    level[:, [0, size - 1]] = 0
    return level


def _reverse_play(floor: list[bool], width: int, targets: list[int], player: int, search_depth: int):
    """RAGEN's depth-first reverse play: the player walks and pulls the box behind it.

    Returns (score, player, box positions, box displacement) of the best-scored state, where
    score = box_swaps * displacement and states with a covered target score 0 (gym-sokoban).
    Like RAGEN, a state is expanded only on its first visit and never below the depth limit.
    """
    offsets = [dr * width + dc for dr, dc in DIRS]
    explored: set = set()
    best = [-1, player, tuple(targets), 0]

    def visit(p, pos, pulled, swaps, last, ttl):
        ttl -= 1
        key = (p, tuple(sorted(zip(pos, pulled))))
        if ttl <= 0 or len(explored) >= 300_000 or key in explored:
            return
        explored.add(key)
        disp = sum(abs(b // width - t // width) + abs(b % width - t % width) for b, t in zip(pos, targets))
        covered = any(t == p or t in pos for t in targets)
        score = 0 if covered else swaps * disp  # a covered target scores 0
        if score > best[0]:
            best[:] = [score, p, pos, disp]
        for off in offsets:
            q = p + off
            if not floor[q] or q in pos:
                continue  # RAGEN recurses into the unchanged state, which returns at once
            pos2, pulled2, last2 = pos, pulled, last
            if p - off in pos:  # the box behind the player is pulled along
                k = pos.index(p - off)
                pos2, pulled2, last2 = pos[:k] + (p,) + pos[k + 1:], pulled[:k] + (True,) + pulled[k + 1:], k
            visit(q, pos2, pulled2, swaps + (last2 != last), last2, ttl)

    visit(player, tuple(targets), (False,) * len(targets), 0, -1, search_depth)
    return best


def _try_room(rng: np.random.Generator, size: int, num_boxes: int, search_depth: int):
    """One gym-sokoban generate_room call: up to 4 topologies; None where gym-sokoban raises."""
    for _ in range(4):
        level = _room_topology(rng, size)
        free = np.flatnonzero(level.ravel() == 1).tolist()
        if len(free) <= num_boxes + 1:
            return None  # "not enough free spots"
        player = free[rng.integers(len(free))]
        targets: list[int] = []
        for _ in range(num_boxes):
            spots = [c for c in free if c != player and c not in targets]
            targets.append(spots[rng.integers(len(spots))])
        floor = level.ravel().astype(bool).tolist()
        _, player, boxes, disp = _reverse_play(floor, size, targets, player, search_depth)
        if disp > 0:
            return floor, targets, player, boxes, disp
    return None  # "Generated Model with score == 0"


def generate_sokoban_room(rng: np.random.Generator, size: int, num_boxes: int, search_depth: int):
    """One solvable room: (floor [size*size] bools, targets, player, boxes) as flat cell indices."""
    for _ in range(1000):  # RAGEN retries a failed room with a new seed; we continue the stream
        room = _try_room(rng, size, num_boxes, search_depth)
        if room is None:
            continue
        floor, targets, player, boxes, disp = room
        # RAGEN: a few random player moves so that the player is not always next to a box.
        if rng.random() <= (0.8 if disp == 1 else 0.5):
            seen = [player]
            for steps in range(1, 4):
                options = [player + dr * size + dc for dr, dc in DIRS]
                options = [q for q in options if floor[q] and q not in boxes and q not in seen]
                if not options:
                    break
                player = options[rng.integers(len(options))]
                seen.append(player)
                if steps >= 3 or rng.random() > 0.5:
                    break
        return floor, frozenset(targets), player, tuple(sorted(boxes))
    raise RuntimeError(f"sokoban: no room after 1000 attempts (size={size}, num_boxes={num_boxes})")


# ------------------------------------------------------------------------------------------------ FrozenLake

LAKE_DIRS = ((0, -1), (1, 0), (0, 1), (-1, 0))  # Left, Down, Right, Up (gymnasium's order)


def lake_reachable(board: np.ndarray, start: tuple, goal: tuple) -> bool:
    stack, seen = [start], {start}
    while stack:
        cell = stack.pop()
        if cell == goal:
            return True
        for q in (lake_next(board.shape[0], cell, d) for d in range(4)):  # off the board: `cell`, seen
            if q not in seen and board[q] != "H":
                seen.add(q)
                stack.append(q)
    return False


def generate_lake(rng: np.random.Generator, size: int, p: float):
    """[size, size] array of 'F'/'H'/'G' plus the start cell (drawn like RAGEN's generate_random_map)."""
    while True:
        board = rng.choice(np.array(["F", "H"]), (size, size), p=[p, 1 - p])
        start = tuple(int(x) for x in rng.integers(size, size=2))
        goal = tuple(int(x) for x in rng.integers(size, size=2))
        if start != goal:
            board[start], board[goal] = "F", "G"
            if lake_reachable(board, start, goal):
                return board, start


def lake_next(n: int, cell: tuple, d: int) -> tuple:
    r, c = cell[0] + LAKE_DIRS[d][0], cell[1] + LAKE_DIRS[d][1]
    return (r, c) if 0 <= r < n and 0 <= c < n else cell


def lake_policy(board: np.ndarray, slippery: bool) -> np.ndarray:
    """The expert's action per cell [n*n]: the most likely to ever reach the goal, ties by the 0.9-discounted
    success value (RAGEN has no FrozenLake expert)."""
    n = board.shape[0]
    S = n * n
    P = np.zeros((S, 4, S))  # [S, 4, S] transition probabilities; terminal rows stay zero
    for s in range(S):
        if board[divmod(s, n)] in ("H", "G"):
            continue
        for a in range(4):
            for d in ((a - 1) % 4, a, (a + 1) % 4) if slippery else (a,):
                r, c = lake_next(n, divmod(s, n), d)
                P[s, a, r * n + c] += 1.0 / 3.0 if slippery else 1.0
    terminal = np.isin(board.ravel(), ["H", "G"])
    goal = (board.ravel() == "G").astype(float)
    V = goal.copy()
    for _ in range(100_000):  # undiscounted: converges to the maximal reach probability
        V_new = np.where(terminal, goal, (P @ V).max(axis=1))
        if np.abs(V_new - V).max() < 1e-13:
            break
        V = V_new
    keep = P @ V >= V[:, None] - 1e-9  # [S, 4] actions that keep the best success probability
    U = goal.copy()
    for _ in range(10_000):
        U_new = np.where(terminal, goal, np.where(keep, 0.9 * (P @ U), -1.0).max(axis=1))
        if np.abs(U_new - U).max() < 1e-13:
            break
        U = U_new
    return np.where(keep, 0.9 * (P @ U), -1.0).argmax(axis=1)


# ---- the environments' options (envs.py)

def take_options(env_name: str, defaults: dict, overrides: dict) -> dict:
    """An env's options: its `defaults`, the `overrides` on top; a ValueError names an unknown key."""
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"{env_name}: unknown override(s) {unknown}; allowed: {sorted(defaults)}")
    return {**defaults, **overrides}


def int_option(env_name: str, key: str, value, lo: int, hi: float = float("inf")) -> int:
    """`value` as an int in [lo, hi], else a ValueError that names the env and the key."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        allowed = f"in [{lo}, {hi}]" if hi < float("inf") else f">= {lo}"
        raise ValueError(f"{env_name}: {key} must be an int {allowed}, got {value!r}")
    return int(value)


def float_option(env_name: str, key: str, value, lo: float, hi: float) -> float:
    """`value` (an int or a float, not a bool) as a float in [lo, hi], else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)) or not lo <= value <= hi:
        raise ValueError(f"{env_name}: {key} must be in [{lo:g}, {hi:g}], got {value!r}")
    return float(value)


def bool_option(env_name: str, key: str, value) -> bool:
    """`value` as a bool (True or False, numpy's too), else a ValueError."""
    if not isinstance(value, (bool, np.bool_)):
        raise ValueError(f"{env_name}: {key} must be True or False, got {value!r}")
    return bool(value)
