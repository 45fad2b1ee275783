"""Text environments of the RAGEN paper (section 3.1): Bandit (three arm namings), Sokoban (three variants),
FrozenLake; WebShop, the fourth and largest, lives in extras/webshop.py.

Every environment is a small, seeded, text-in/text-out class with one public shape (`name`, `actions`,
`instruction`, `reset(seed, sample=0) -> observation`, `step(action) -> (observation, reward, done, info)`,
`render()`, `expert_action()`, `done`); `make_env` builds one by name. Bandit: one pull, stochastic payoff,
risk-sensitive reasoning; Sokoban: multi-turn, deterministic, irreversible pushes; FrozenLake: multi-turn,
slippery. The initial state comes from a generator seeded by `reset(seed)`, the dynamics' noise (payoffs,
slips) from one seeded by (seed, sample): the N rollouts of a group share both, as RAGEN seeds them.
Evaluation uses 256 fixed prompts (section 3.3, `EVAL_SEEDS`); `train_seeds` never draws one. The experts
(Sokoban: a fewest-moves BFS; FrozenLake: the success-maximising policy) feed the SFT baseline and the tests.
Deviations from RAGEN (generators, Bandit's 0.15 arm, the experts): docs/faithfulness.md. Next: rollout.py.
"""
from __future__ import annotations

import numpy as np

EVAL_SEEDS = list(range(123, 379))  # the paper's 256 fixed evaluation prompts (Section 3.3)
TRAIN_SEED_LOW, TRAIN_SEED_HIGH = 1000, 2**31  # training seeds live here, far from EVAL_SEEDS


def train_seeds(rng_or_seed, n: int) -> list[int]:
    """n distinct training seeds from [1000, 2**31), never one of EVAL_SEEDS."""
    rng = rng_or_seed if isinstance(rng_or_seed, np.random.Generator) else np.random.default_rng(rng_or_seed)
    seeds: dict[int, None] = {}  # an ordered set: each seed at its first draw
    while len(seeds) < n:
        draw = rng.integers(TRAIN_SEED_LOW, TRAIN_SEED_HIGH, size=n - len(seeds))
        seeds.update(dict.fromkeys(draw.tolist()))
    return list(seeds)


def _take_options(env_name: str, defaults: dict, overrides: dict) -> dict:
    unknown = sorted(set(overrides) - set(defaults))
    if unknown:
        raise ValueError(f"{env_name}: unknown override(s) {unknown}; allowed: {sorted(defaults)}")
    return {**defaults, **overrides}


def _int_option(env_name: str, key: str, value, lo: int, hi: float = float("inf")) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        allowed = f"in [{lo}, {hi}]" if hi < float("inf") else f">= {lo}"
        raise ValueError(f"{env_name}: {key} must be an int {allowed}, got {value!r}")
    return int(value)


class _TextEnv:
    """The shared guard logic: reset before use, parse action words, refuse to step a finished episode. A
    subclass writes `_start(seed, noise)` (its initial state), `_render`, `_success`, `_apply(i)` and
    `expert_action`."""

    name = ""
    actions: list[str] = []

    def __init__(self):
        self.done = False
        self._ready = False
        self._lookup = {a.lower(): i for i, a in enumerate(self.actions)}

    def _parse(self, action):
        return self._lookup.get(action.strip().lower()) if isinstance(action, str) else None

    def _require_live(self, what: str):
        if not self._ready:
            raise RuntimeError(f"{self.name}: call reset(seed) before {what}")
        if self.done:
            raise RuntimeError(f"{self.name}: the episode is over; call reset(seed) before {what}")

    def reset(self, seed: int, sample: int = 0) -> str:
        seed, sample = _int_option(self.name, "seed", seed, 0), _int_option(self.name, "sample", sample, 0)
        self._start(seed, np.random.default_rng([seed, sample]))  # the start from seed; noise: (seed, sample)
        self.done, self._ready = False, True
        return self._render()

    def render(self) -> str:
        if not self._ready:
            raise RuntimeError(f"{self.name}: call reset(seed) before render()")
        return self._render()

    def step(self, action):
        self._require_live("step()")
        i = self._parse(action)
        if i is None:  # an unknown word changes nothing and earns nothing
            info = {"success": self._success(), "action_is_valid": False, "action_is_effective": False}
            return self._render(), 0.0, False, info
        return self._apply(i)


# ------------------------------- Bandit (section 3.1; Appendix: safe arm 0.15, risky arm 1.0 with p 0.25)

class BanditEnv(_TextEnv):
    name = "bandit"
    DEFAULTS = {"safe_name": "Phoenix", "risky_name": "Dragon"}
    SAFE_PAYOFF = 0.15
    RISKY_PAYOFF, RISKY_PROB = 1.0, 0.25

    def __init__(self, **overrides):
        opts = _take_options(self.name, self.DEFAULTS, overrides)
        for key in ("safe_name", "risky_name"):
            v = opts[key]
            if not (isinstance(v, str) and v.isascii() and v.isalpha() and len(v) <= 32):
                raise ValueError(f"{self.name}: {key} must be one ASCII word of letters (e.g. 'Phoenix'), "
                                 f"got {v!r}")
        if opts["safe_name"].lower() == opts["risky_name"].lower():
            raise ValueError(f"{self.name}: safe_name and risky_name must differ, got {opts['safe_name']!r} "
                             f"twice")
        self.safe_name, self.risky_name = opts["safe_name"], opts["risky_name"]
        self.actions = sorted([self.safe_name, self.risky_name], key=str.lower)
        self.instruction = (
            "You are playing a bandit game. There are two arms, each with its own reward distribution "
            "related to its name. Pull one arm; the game ends after one pull.\n"
            f"Actions: {', '.join(self.actions)}"
        )
        super().__init__()

    def _start(self, seed: int, noise: np.random.Generator):
        first, second = self.actions if np.random.default_rng(seed).random() < 0.5 else self.actions[::-1]
        self._rng, self._obs, self._pulled = noise, f"Arms: {first}, {second}", None  # noise: the payoffs

    def _render(self) -> str:
        return self._obs

    def _success(self) -> bool:
        return self._pulled == self.risky_name

    def _apply(self, i: int):
        arm = self.actions[i]
        if arm == self.risky_name:
            reward = self.RISKY_PAYOFF if self._rng.random() < self.RISKY_PROB else 0.0
        else:
            reward = self.SAFE_PAYOFF
        self._pulled, self.done = arm, True
        self._obs = f"{arm}: {reward:g} points"
        info = {"success": self._success(), "action_is_valid": True, "action_is_effective": True}
        return self._obs, reward, True, info

    def expert_action(self) -> str:
        self._require_live("expert_action()")
        return self.risky_name  # higher mean (0.25 > 0.15) and the definition of success


class BanditRevEnv(BanditEnv):
    """Same names, roles swapped: tests whether a policy learnt the names or the payoffs (Table 3)."""
    name = "bandit-rev"
    DEFAULTS = {"safe_name": "Dragon", "risky_name": "Phoenix"}


class BanditTestEnv(BanditEnv):
    """RAGEN's held-out names (config/envs.yaml BanditTest): does what was learnt on Phoenix/Dragon
    transfer?"""
    name = "bandit-test"
    DEFAULTS = {"safe_name": "Trader", "risky_name": "Librarian"}


# ------------------------- Sokoban (section 3.1): reverse-play generation as RAGEN / gym-sokoban, BFS expert

SOKOBAN_SYMBOLS = {  # order: wall, empty, target, box, box on target, player, player on target
    "classic": ("#", "_", "O", "X", "√", "P", "S"),
    "newvocab": ("W", ".", "G", "B", "C", "A", "@"),
}
_SOKOBAN_WORDS = ("wall", "empty", "target", "box", "box on target", "player", "player on target")
_DIRS = ((-1, 0), (1, 0), (0, -1), (0, 1))  # Up, Down, Left, Right (gym-sokoban's order)
_MASKS = (  # gym-sokoban's random-walk stamps: 1 = floor, centred on the walker
    ((0, 0, 0), (1, 1, 1), (0, 0, 0)),
    ((0, 1, 0), (0, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (0, 1, 0)),
    ((0, 0, 0), (1, 1, 0), (1, 1, 0)),
    ((0, 0, 0), (0, 1, 1), (0, 1, 0)),
)


def _room_topology(rng: np.random.Generator, size: int) -> np.ndarray:
    """Random-walk floor plan, [size, size] with 1 = floor; the border is always wall."""
    level = np.zeros((size, size), dtype=np.int64)
    direction = _DIRS[rng.integers(4)]
    pos = [int(rng.integers(1, size)), int(rng.integers(1, size))]
    for _ in range(int(1.7 * (size + size))):
        if rng.random() < 0.35:
            direction = _DIRS[rng.integers(4)]
        pos = [min(max(pos[0] + direction[0], 1), size - 2), min(max(pos[1] + direction[1], 1), size - 2)]
        level[pos[0] - 1:pos[0] + 2, pos[1] - 1:pos[1] + 2] += np.array(_MASKS[rng.integers(len(_MASKS))])
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
    offsets = [dr * width + dc for dr, dc in _DIRS]
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
                options = [player + dr * size + dc for dr, dc in _DIRS]
                options = [q for q in options if floor[q] and q not in boxes and q not in seen]
                if not options:
                    break
                player = options[rng.integers(len(options))]
                seen.append(player)
                if steps >= 3 or rng.random() > 0.5:
                    break
        return floor, frozenset(targets), player, tuple(sorted(boxes))
    raise RuntimeError(f"sokoban: no room after 1000 attempts (size={size}, num_boxes={num_boxes})")


def _push(floor, player: int, boxes: tuple, off: int) -> tuple:
    """(player, boxes) after a step of `off` cells that may push one box; a blocked step, or one that
    pushes no box, returns the same `boxes` object."""
    q = player + off
    if not floor[q] or (q in boxes and (not floor[q + off] or q + off in boxes)):
        return player, boxes
    return q, (tuple(sorted(q + off if b == q else b for b in boxes)) if q in boxes else boxes)


def sokoban_bfs(floor, width: int, targets, player: int, boxes: tuple) -> list[int] | None:
    """Fewest-moves plan (action indices Up/Down/Left/Right) to put every box on a target, or None."""
    if all(b in targets for b in boxes):
        return []
    offsets = [dr * width + dc for dr, dc in _DIRS]
    start = (player, boxes)
    parent = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for state in frontier:
            for a, off in enumerate(offsets):
                child = _push(floor, *state, off)  # a blocked step gives `state`, already in parent
                if child in parent:
                    continue
                parent[child] = (state, a)
                if child[1] is not state[1] and all(b in targets for b in child[1]):  # only a push can solve
                    plan = []
                    while parent[child] is not None:
                        child, a = parent[child]
                        plan.append(a)
                    return plan[::-1]
                nxt.append(child)
        frontier = nxt
    return None


class SokobanEnv(_TextEnv):
    name = "sokoban"
    actions = ["Up", "Down", "Left", "Right"]
    DEFAULTS = {"size": 6, "num_boxes": 1, "search_depth": 300}
    SYMBOLS = SOKOBAN_SYMBOLS["classic"]

    def __init__(self, **overrides):
        opts = _take_options(self.name, self.DEFAULTS, overrides)
        # Bounds keep the expert's full BFS over (player, boxes) states fast in pure Python.
        self.size = _int_option(self.name, "size", opts["size"], 5, 8)
        self.num_boxes = _int_option(self.name, "num_boxes", opts["num_boxes"], 1, 2)
        self.search_depth = _int_option(self.name, "search_depth", opts["search_depth"], 2, 300)
        legend = ", ".join(f"{s} {w}" for s, w in zip(self.SYMBOLS, _SOKOBAN_WORDS))
        self.instruction = (
            "You are solving the Sokoban puzzle. You are the player and you need to push all boxes to "
            "targets. When you are right next to a box, you can push it by moving in the same direction. "
            "You cannot push a box through a wall, and you cannot pull a box.\n"
            f"Symbols: {legend}\n"
            f"Actions: {', '.join(self.actions)}"
        )
        self._offsets = [dr * self.size + dc for dr, dc in _DIRS]  # a move as a step in the flat board index
        super().__init__()

    def _start(self, seed: int, noise):  # deterministic dynamics: the noise (`sample`) changes nothing
        self._floor, self._targets, self._player, self._boxes = generate_sokoban_room(
            np.random.default_rng(seed), self.size, self.num_boxes, self.search_depth)
        self._plans: dict = {}  # (player, boxes) -> remaining optimal plan, filled by expert_action

    def _on_target(self) -> int:
        return sum(b in self._targets for b in self._boxes)

    def _success(self) -> bool:
        return self._on_target() == len(self._boxes)

    def _move(self, player: int, boxes: tuple, a: int):
        return _push(self._floor, player, boxes, self._offsets[a])

    def _apply(self, a: int):
        before, moved_from = self._on_target(), self._player
        self._player, self._boxes = self._move(self._player, self._boxes, a)
        after = self._on_target()
        self.done = success = after == len(self._boxes)
        # gym-sokoban's reward: -0.1 a step, +-1 a box on or off a target, +10 solved
        reward = -0.1 + (1.0 if after > before else -1.0 if after < before else 0.0) + 10.0 * success
        info = {"success": success, "action_is_valid": True,
                "action_is_effective": self._player != moved_from}
        return self._render(), reward, success, info

    def _render(self) -> str:
        def symbol(c):  # SYMBOLS order: wall, empty, target, box, box on target, player, player on target
            k = (5 if c == self._player else 3 if c in self._boxes else 1) + (c in self._targets)
            return self.SYMBOLS[k if self._floor[c] else 0]
        n = self.size
        return "\n".join("".join(symbol(c) for c in range(r * n, (r + 1) * n)) for r in range(n))

    def _cell(self, i: int) -> str:
        return f"{i // self.size + 1} {i % self.size + 1}"  # row, column from 1 (top-left wall)

    def describe(self) -> str:
        """Where things are, in words: "player at 3 5, box at 4 4, target at 5 3" (the expert's thought)."""
        self._require_live("describe()")
        return ", ".join([f"player at {self._cell(self._player)}"]
                         + [f"box at {self._cell(b)}" for b in self._boxes]
                         + [f"target at {self._cell(t)}" for t in sorted(self._targets)])

    def expert_note(self) -> str:
        """The start of the expert's thought: where things are, then the next push of its plan and the cell
        it pushes from ("player at 3 5, box at 4 4, target at 5 3. I push the box Left: I go to 4 5")."""
        return self._note(self._expert_plan() or [])

    def _note(self, plan: list[int]) -> str:
        cell, note = self._cell, self.describe()
        push = self._first_push(plan)
        if push is not None:
            a, stand, box = push
            which = f" at {cell(box)}" if len(self._boxes) > 1 else ""  # several boxes: name the one pushed
            note += f". I push the box{which} {self.actions[a]}: I go to {cell(stand)}"
        return note

    def _first_push(self, plan: list[int]):
        """(action, the player's cell before it, the box's cell) of the first move in `plan` that pushes."""
        player, boxes = self._player, self._boxes
        for a in plan:
            nxt = self._move(player, boxes, a)
            if nxt[1] != boxes:
                return a, player, player + self._offsets[a]
            player, boxes = nxt
        return None

    def _expert_plan(self) -> list[int] | None:
        """The rest of a fewest-moves plan from the current state (action indices), None if there is none."""
        state = (self._player, self._boxes)
        if state not in self._plans:
            plan = sokoban_bfs(self._floor, self.size, self._targets, *state)
            if plan is None:
                self._plans[state] = None
            else:  # every state along an optimal plan gets the rest of that plan
                s = state
                for i, a in enumerate(plan):
                    self._plans.setdefault(s, plan[i:])
                    s = self._move(*s, a)
        return self._plans[state]

    def expert_action(self) -> str:
        self._require_live("expert_action()")
        plan = self._expert_plan()
        return self.actions[plan[0]] if plan else self.actions[0]


class SokobanNewVocabEnv(SokobanEnv):
    name = "sokoban-newvocab"
    DEFAULTS = {"size": 6, "num_boxes": 1, "search_depth": 30}  # RAGEN SokobanDifferentGridVocab
    SYMBOLS = SOKOBAN_SYMBOLS["newvocab"]


class LargeSokobanEnv(SokobanEnv):
    name = "sokoban-large"
    DEFAULTS = {"size": 8, "num_boxes": 2, "search_depth": 10}  # RAGEN LargerSokoban


# -------------- FrozenLake (section 3.1): RAGEN's random maps, gymnasium's slips, a value-iteration expert

_LAKE_DIRS = ((0, -1), (1, 0), (0, 1), (-1, 0))  # Left, Down, Right, Up (gymnasium's order)


def _lake_reachable(board: np.ndarray, start: tuple, goal: tuple) -> bool:
    stack, seen = [start], {start}
    while stack:
        cell = stack.pop()
        if cell == goal:
            return True
        for q in (_lake_next(board.shape[0], cell, d) for d in range(4)):  # off the board: `cell`, seen
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
            if _lake_reachable(board, start, goal):
                return board, start


def _lake_next(n: int, cell: tuple, d: int) -> tuple:
    r, c = cell[0] + _LAKE_DIRS[d][0], cell[1] + _LAKE_DIRS[d][1]
    return (r, c) if 0 <= r < n and 0 <= c < n else cell


def lake_policy(board: np.ndarray, slippery: bool) -> np.ndarray:
    """Greedy action per cell [n*n]: maximise P(reach goal), then the 0.9-discounted success value."""
    n = board.shape[0]
    S = n * n
    P = np.zeros((S, 4, S))  # [S, 4, S] transition probabilities; terminal rows stay zero
    for s in range(S):
        if board[divmod(s, n)] in ("H", "G"):
            continue
        for a in range(4):
            for d in ((a - 1) % 4, a, (a + 1) % 4) if slippery else (a,):
                r, c = _lake_next(n, divmod(s, n), d)
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
        Q = np.where(keep, 0.9 * (P @ U), -1.0)
        U_new = np.where(terminal, goal, Q.max(axis=1))
        if np.abs(U_new - U).max() < 1e-13:
            break
        U = U_new
    return np.where(keep, 0.9 * (P @ U), -1.0).argmax(axis=1)


class FrozenLakeEnv(_TextEnv):
    name = "frozenlake"
    actions = ["Left", "Down", "Right", "Up"]
    DEFAULTS = {"size": 4, "p": 0.8, "slippery": True}

    def __init__(self, **overrides):
        opts = _take_options(self.name, self.DEFAULTS, overrides)
        self.size = _int_option(self.name, "size", opts["size"], 2, 8)
        p = opts["p"]
        if isinstance(p, bool) or not isinstance(p, (int, float, np.floating)) or not 0.5 <= p <= 1.0:
            raise ValueError(f"{self.name}: p (probability a tile is frozen) must be a number in [0.5, 1], "
                             f"got {p!r}")
        self.p = float(p)
        if not isinstance(opts["slippery"], (bool, np.bool_)):
            raise ValueError(f"{self.name}: slippery must be True or False, got {opts['slippery']!r}")
        self.slippery = bool(opts["slippery"])
        slip = (" The ice is slippery: you may move in an unintended direction." if self.slippery else "")
        self.instruction = (
            f"You are solving the FrozenLake puzzle. Avoid the holes and go to the goal.{slip}\n"
            "Symbols: P player, _ frozen, O hole, G goal, X player in hole, √ player on goal\n"
            f"Actions: {', '.join(self.actions)}"
        )
        super().__init__()

    def _start(self, seed: int, noise: np.random.Generator):
        self._board, self._pos = generate_lake(np.random.default_rng(seed), self.size, self.p)
        self._rng, self._policy = noise, None  # noise: the slips; the policy: at the first expert_action()

    def _success(self) -> bool:
        return self._board[self._pos] == "G"

    def _apply(self, a: int):
        d = (a + int(self._rng.integers(3)) - 1) % 4 if self.slippery else a
        before = self._pos
        self._pos = _lake_next(self.size, self._pos, d)
        tile = self._board[self._pos]
        self.done = tile in ("H", "G")
        reward = 1.0 if tile == "G" else 0.0
        info = {"success": tile == "G", "action_is_valid": True, "action_is_effective": self._pos != before}
        return self._render(), reward, self.done, info

    def _render(self) -> str:
        tiles, here = {"F": "_", "H": "O", "G": "G"}, {"F": "P", "H": "X", "G": "√"}  # here: player's cell
        return "\n".join("".join((here if (r, c) == self._pos else tiles)[self._board[r, c]]
                                 for c in range(self.size)) for r in range(self.size))

    def describe(self) -> str:
        """Where things are, in words: "player at 1 2, goal at 4 4, hole at 2 2, hole at 3 1"."""
        self._require_live("describe()")
        cell = lambda rc: f"{rc[0] + 1} {rc[1] + 1}"  # row, column from 1 at the top left
        holes = [f"hole at {cell(rc)}" for rc in zip(*np.nonzero(self._board == "H"))]
        goal = tuple(int(x) for x in np.argwhere(self._board == "G")[0])
        return ", ".join([f"player at {cell(self._pos)}", f"goal at {cell(goal)}"] + holes)

    def expert_note(self) -> str:  # the expert's thought starts with where things are
        return self.describe()

    def expert_action(self) -> str:
        self._require_live("expert_action()")
        if self._policy is None:
            self._policy = lake_policy(self._board, self.slippery)
        return self.actions[int(self._policy[self._pos[0] * self.size + self._pos[1]])]


# ------------------------------------------------------------------------------------------------ registry

def _webshop(**overrides):
    """WebShop (extras/webshop.py: a shop, its catalogue, BM25 search), imported when a run asks for it."""
    from extras.webshop import WebShopEnv
    return WebShopEnv(**overrides)


ENVS = {env.name: env for env in (BanditEnv, BanditRevEnv, BanditTestEnv, SokobanEnv, SokobanNewVocabEnv,
                                  LargeSokobanEnv, FrozenLakeEnv)}
ENVS["webshop"] = _webshop


def make_env(name: str, **overrides):
    """A fresh environment by name; overrides change its options (ValueError names what is allowed)."""
    if not isinstance(name, str) or name not in ENVS:
        raise ValueError(f"unknown env {name!r}; allowed: {sorted(ENVS)}")
    return ENVS[name](**overrides)
