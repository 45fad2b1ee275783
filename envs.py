"""The paper's environments (section 3.1): Bandit, Sokoban, FrozenLake, as text in, text out.

One shape: `name`, `actions`, `instruction`, `reset(seed, sample=0) -> text`, `step(action) -> (text,
reward, done, info)`, `render()`, `expert_action()`, `done`. Bandit: one stochastic pull; Sokoban: many
turns, irreversible pushes; FrozenLake: slippery. The start comes from `seed`, the noise from (seed, sample):
a group's N rollouts share both, as in RAGEN. Eval uses 256 fixed prompts (section 3.3), never trained on.
The experts feed the SFT baseline. Rooms: engine/rooms.py; WebShop: extras/webshop.py. Next: rollout.py.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.rooms import (DIRS, bool_option, float_option, generate_lake, generate_sokoban_room, int_option,
                          lake_next, lake_policy, take_options)

EVAL_SEEDS = list(range(123, 379))  # the paper's 256 fixed evaluation prompts (section 3.3)
TRAIN_SEED_LOW, TRAIN_SEED_HIGH = 1000, 2**31  # far from EVAL_SEEDS


def train_seeds(rng_or_seed, n: int) -> list[int]:
    """n distinct training seeds from [1000, 2**31), never one of EVAL_SEEDS."""
    rng = rng_or_seed if isinstance(rng_or_seed, np.random.Generator) else np.random.default_rng(rng_or_seed)
    seeds: dict[int, None] = {}  # an ordered set
    while len(seeds) < n:
        draw = rng.integers(TRAIN_SEED_LOW, TRAIN_SEED_HIGH, size=n - len(seeds))
        seeds.update(dict.fromkeys(draw.tolist()))
    return list(seeds)


class _TextEnv:
    """Shared rules: reset before use, no step after the end. A subclass writes `_start(seed, noise)`,
    `_render`, `_success`, `_apply(i)` and `expert_action`."""
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
        seed, sample = int_option(self.name, "seed", seed, 0), int_option(self.name, "sample", sample, 0)
        self._start(seed, np.random.default_rng([seed, sample]))
        self.done, self._ready = False, True
        return self._render()

    def render(self) -> str:
        if not self._ready:
            raise RuntimeError(f"{self.name}: call reset(seed) before render()")
        return self._render()

    def step(self, action):
        self._require_live("step()")
        i = self._parse(action)
        if i is None:  # an unknown word changes nothing
            info = {"success": self._success(), "action_is_valid": False, "action_is_effective": False}
            return self._render(), 0.0, False, info
        return self._apply(i)


# ---- Bandit (Appendix: safe arm 0.15, risky 1.0 with p 0.25)

class BanditEnv(_TextEnv):
    name = "bandit"
    DEFAULTS = {"safe_name": "Phoenix", "risky_name": "Dragon"}
    SAFE_PAYOFF = 0.15  # the paper's (RAGEN's code: 0.1)
    RISKY_PAYOFF, RISKY_PROB = 1.0, 0.25

    def __init__(self, **overrides):
        opts = take_options(self.name, self.DEFAULTS, overrides)
        for key in ("safe_name", "risky_name"):
            v = opts[key]
            if not (isinstance(v, str) and v.isascii() and v.isalpha() and len(v) <= 32):
                raise ValueError(f"{self.name}: {key} must be one ASCII word of letters, got {v!r}")
        if opts["safe_name"].lower() == opts["risky_name"].lower():
            raise ValueError(f"{self.name}: safe_name and risky_name must differ, got {opts['safe_name']!r}")
        self.safe_name, self.risky_name = opts["safe_name"], opts["risky_name"]
        self.actions = sorted([self.safe_name, self.risky_name], key=str.lower)
        self.instruction = ("You are playing a bandit game. There are two arms, each with its own reward "
                            "distribution related to its name. Pull one arm; the game ends after one pull.\n"
                            f"Actions: {', '.join(self.actions)}")
        super().__init__()

    def _start(self, seed: int, noise: np.random.Generator):
        first, second = self.actions if np.random.default_rng(seed).random() < 0.5 else self.actions[::-1]
        self._rng, self._obs, self._pulled = noise, f"Arms: {first}, {second}", None

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
        return self._obs, reward, True, {"success": self._success(), "action_is_valid": True,
                                         "action_is_effective": True}

    def expert_action(self) -> str:
        self._require_live("expert_action()")
        return self.risky_name  # the higher mean (0.25 > 0.15)


class BanditRevEnv(BanditEnv):
    """The names' roles swapped: did the policy learn the names or the payoffs? (Table 3)"""
    name = "bandit-rev"
    DEFAULTS = {"safe_name": "Dragon", "risky_name": "Phoenix"}


class BanditTestEnv(BanditEnv):
    """RAGEN's held-out names (config/envs.yaml BanditTest)."""
    name = "bandit-test"
    DEFAULTS = {"safe_name": "Trader", "risky_name": "Librarian"}


# ---- Sokoban: gym-sokoban's rules, a BFS expert

SOKOBAN_SYMBOLS = {  # wall, empty, target, box, box on target, player, player on target
    "classic": ("#", "_", "O", "X", "√", "P", "S"),
    "newvocab": ("W", ".", "G", "B", "C", "A", "@")}
_SOKOBAN_WORDS = ("wall", "empty", "target", "box", "box on target", "player", "player on target")


def _push(floor, player: int, boxes: tuple, off: int) -> tuple:
    """(player, boxes) after a step of `off` cells, which may push a box (no push: the same `boxes`)."""
    q = player + off
    if not floor[q] or (q in boxes and (not floor[q + off] or q + off in boxes)):
        return player, boxes
    return q, (tuple(sorted(q + off if b == q else b for b in boxes)) if q in boxes else boxes)


def sokoban_bfs(floor, width: int, targets, player: int, boxes: tuple) -> list[int] | None:
    """A fewest-moves plan (action indices) that puts every box on a target, or None."""
    if all(b in targets for b in boxes):
        return []
    offsets = [dr * width + dc for dr, dc in DIRS]
    start = (player, boxes)
    parent = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for state in frontier:
            for a, off in enumerate(offsets):
                child = _push(floor, *state, off)
                if child in parent:
                    continue
                parent[child] = (state, a)
                if child[1] is not state[1] and all(b in targets for b in child[1]):
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
        opts = take_options(self.name, self.DEFAULTS, overrides)
        self.size = int_option(self.name, "size", opts["size"], 5, 8)  # the BFS stays fast
        self.num_boxes = int_option(self.name, "num_boxes", opts["num_boxes"], 1, 2)
        self.search_depth = int_option(self.name, "search_depth", opts["search_depth"], 2, 300)
        legend = ", ".join(f"{s} {w}" for s, w in zip(self.SYMBOLS, _SOKOBAN_WORDS))
        self.instruction = ("You are solving the Sokoban puzzle. You are the player and you need to "
                            "push all boxes to targets. When you are right next to a box, you can push it by "
                            "moving in the same direction. You cannot push a box through a wall, and you "
                            "cannot pull a box.\n"
                            f"Symbols: {legend}\nActions: {', '.join(self.actions)}")
        self._offsets = [dr * self.size + dc for dr, dc in DIRS]  # moves in the flat board
        super().__init__()

    def _start(self, seed: int, noise):  # deterministic: no noise
        self._floor, self._targets, self._player, self._boxes = generate_sokoban_room(
            np.random.default_rng(seed), self.size, self.num_boxes, self.search_depth)
        self._plans: dict = {}  # (player, boxes) -> the rest of an optimal plan

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
        # gym-sokoban's reward: -0.1 a step, +1 / -1 a box on / off a target, +10 solved
        change = 0.0
        if after > before:
            change = 1.0
        elif after < before:
            change = -1.0
        reward = -0.1 + change + 10.0 * success
        return self._render(), reward, success, {"success": success, "action_is_valid": True,
                                                 "action_is_effective": self._player != moved_from}

    def _render(self) -> str:
        def symbol(c):  # SYMBOLS: wall, empty, target, box, box on target, player, player on target
            if not self._floor[c]:
                return self.SYMBOLS[0]
            k = 1
            if c == self._player:
                k = 5
            elif c in self._boxes:
                k = 3
            return self.SYMBOLS[k + (c in self._targets)]
        n = self.size
        return "\n".join("".join(symbol(c) for c in range(r * n, (r + 1) * n)) for r in range(n))

    def _cell(self, i: int) -> str:
        return f"{i // self.size + 1} {i % self.size + 1}"  # row, column from 1

    def describe(self) -> str:
        """In words ("player at 3 5, box at 4 4, target at 5 3"): the expert's thought."""
        self._require_live("describe()")
        return ", ".join([f"player at {self._cell(self._player)}"]
                         + [f"box at {self._cell(b)}" for b in self._boxes]
                         + [f"target at {self._cell(t)}" for t in sorted(self._targets)])

    def expert_note(self) -> str:
        """The expert's thought: where things are, its next push ("...: I go to 4 5")."""
        return self._note(self._expert_plan() or [])

    def _note(self, plan: list[int]) -> str:
        note, push = self.describe(), self._first_push(plan)
        if push is not None:
            a, stand, box = push
            which = f" at {self._cell(box)}" if len(self._boxes) > 1 else ""
            note += f". I push the box{which} {self.actions[a]}: I go to {self._cell(stand)}"
        return note

    def _first_push(self, plan: list[int]):
        """(action, player's cell, box's cell) of the first push in `plan`."""
        player, boxes = self._player, self._boxes
        for a in plan:
            nxt = self._move(player, boxes, a)
            if nxt[1] != boxes:
                return a, player, player + self._offsets[a]
            player, boxes = nxt
        return None

    def _expert_plan(self) -> list[int] | None:
        """The rest of a fewest-moves plan from here, or None."""
        state = (self._player, self._boxes)
        if state not in self._plans:
            plan = sokoban_bfs(self._floor, self.size, self._targets, *state)
            if plan is None:
                self._plans[state] = None
            else:  # every state along the plan gets its rest
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
    DEFAULTS = {"size": 6, "num_boxes": 1, "search_depth": 30}  # RAGEN's SokobanDifferentGridVocab
    SYMBOLS = SOKOBAN_SYMBOLS["newvocab"]


class LargeSokobanEnv(SokobanEnv):
    name = "sokoban-large"
    DEFAULTS = {"size": 8, "num_boxes": 2, "search_depth": 10}  # RAGEN's LargerSokoban


# ---- FrozenLake: gymnasium's slips

class FrozenLakeEnv(_TextEnv):
    name = "frozenlake"
    actions = ["Left", "Down", "Right", "Up"]
    DEFAULTS = {"size": 4, "p": 0.8, "slippery": True}

    def __init__(self, **overrides):
        opts = take_options(self.name, self.DEFAULTS, overrides)
        self.size = int_option(self.name, "size", opts["size"], 2, 8)
        self.p = float_option(self.name, "p (probability a tile is frozen)", opts["p"], 0.5, 1.0)
        self.slippery = bool_option(self.name, "slippery", opts["slippery"])
        slip = " The ice is slippery: you may move in an unintended direction." if self.slippery else ""
        symbols = "P player, _ frozen, O hole, G goal, X player in hole, √ player on goal"
        self.instruction = (f"You are solving the FrozenLake puzzle. Avoid the holes and go to the goal."
                            f"{slip}\nSymbols: {symbols}\nActions: {', '.join(self.actions)}")
        super().__init__()

    def _start(self, seed: int, noise: np.random.Generator):
        self._board, self._pos = generate_lake(np.random.default_rng(seed), self.size, self.p)
        self._rng, self._policy = noise, None  # noise: the slips

    def _success(self) -> bool:
        return self._board[self._pos] == "G"

    def _apply(self, a: int):  # gymnasium's slips: intended or either perpendicular, 1/3 each
        d = (a + int(self._rng.integers(3)) - 1) % 4 if self.slippery else a
        before = self._pos
        self._pos = lake_next(self.size, self._pos, d)
        tile = self._board[self._pos]
        self.done = tile in ("H", "G")
        return self._render(), 1.0 if tile == "G" else 0.0, self.done, {
            "success": tile == "G", "action_is_valid": True, "action_is_effective": self._pos != before}

    def _render(self) -> str:
        tiles, here = {"F": "_", "H": "O", "G": "G"}, {"F": "P", "H": "X", "G": "√"}
        return "\n".join("".join((here if (r, c) == self._pos else tiles)[self._board[r, c]]
                                 for c in range(self.size)) for r in range(self.size))

    def describe(self) -> str:
        """In words ("player at 1 2, goal at 4 4, hole at 2 2"): the expert's thought."""
        self._require_live("describe()")
        def cell(rc):  # 1-based "row column"
            return f"{rc[0] + 1} {rc[1] + 1}"
        holes = [f"hole at {cell(rc)}" for rc in zip(*np.nonzero(self._board == "H"))]
        goal = tuple(int(x) for x in np.argwhere(self._board == "G")[0])
        return ", ".join([f"player at {cell(self._pos)}", f"goal at {cell(goal)}"] + holes)

    def expert_note(self) -> str:
        return self.describe()

    def expert_action(self) -> str:
        self._require_live("expert_action()")
        if self._policy is None:
            self._policy = lake_policy(self._board, self.slippery)
        return self.actions[int(self._policy[self._pos[0] * self.size + self._pos[1]])]


# ---- registry

def _webshop(**overrides):  # imported only when a run asks for it
    from extras.webshop import WebShopEnv
    return WebShopEnv(**overrides)


ENVS = {env.name: env for env in (BanditEnv, BanditRevEnv, BanditTestEnv, SokobanEnv, SokobanNewVocabEnv,
                                  LargeSokobanEnv, FrozenLakeEnv)} | {"webshop": _webshop}


def data_rules(data_dir: str | None, envs: list[str]) -> list[tuple[bool, str]]:
    """The rules of --webshop-data, the original WebShop files (section 3.1): a folder, for the webshop
    env only; (holds, one-line error) pairs for cli.check."""
    return [(not data_dir or "webshop" in envs,
             f"--webshop-data {data_dir}: only for the webshop env (this command's: {', '.join(envs)})"),
            (not data_dir or Path(data_dir).is_dir(), f"--webshop-data {data_dir}: no such folder")]


def make_env(name: str, **overrides):
    """A fresh environment by name; `overrides` change its options."""
    if not isinstance(name, str) or name not in ENVS:
        raise ValueError(f"unknown env {name!r}; allowed: {sorted(ENVS)}")
    return ENVS[name](**overrides)
