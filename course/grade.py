"""The course's autograder: each unit's functions against recorded snapshots and properties, on a CPU.

    python course/grade.py                  # units 1-6; a lab is graded only when named (7, 8)
    python course/grade.py 3 4 --json me.json
    python course/grade.py 3 --verbose      # a failure shows its inputs too
    python course/grade.py --record         # the instructor: snapshots from the reference code

One line per unit (`unit 3 advantages: pass 21/21 (15/15 points)`, or the first failure in words), then a
total; exit 0 only when every unit graded passes. Functions are looked up in their modules at call time
(`advantages.gae`), so a test can swap in a mutated one. A snapshot (course/snapshots/unitN-NAME.json) holds
inputs and the reference's outputs. Sokoban's BFS and step are checked with `_push` replaced by a recorded
table of moves, so that a wrong `_push` fails its own checks only. While a unit's function runs, the project
code it reaches is watched: the unit files' own code (given helpers and the student's) is allowed, the rest of
the project (extras/, engine/, tests/, course/, the entry scripts), where some code restates a unit, is not
("Rules" in course/README.md). A lab's line says whether the units it runs on pass.
"""
from __future__ import annotations

import ast
import builtins
import contextlib
import dataclasses
import functools
import inspect
import json
import math
import re
import signal
import sys
import textwrap
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path[:0] = [str(ROOT), str(HERE)]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import advantages  # noqa: E402
import envs  # noqa: E402
import filter as variance_filter  # noqa: E402  (the module, not the builtin)
import monitor  # noqa: E402
import rollout  # noqa: E402
import starpo  # noqa: E402
from engine.cli import Parser  # noqa: E402
from engine.rooms import DIRS  # noqa: E402
from units import BY_NUMBER, GRADED, UNITS, handout  # noqa: E402

SNAPSHOTS = HERE / "snapshots"
STUDENT_MARK = HERE / "STUDENT_COPY"  # written by make.py: a student copy never records snapshots
CHECK_SECONDS = 20  # one check; a function that runs out is not called again
ATOL, RTOL = 1e-5, 1e-4
MOVES = ["Up", "Down", "Left", "Right"]  # envs.SokobanEnv.actions, DIRS' order


class OutOfTime(BaseException):  # not an Exception: a student's `except Exception` must not swallow it
    pass


# ---- snapshots: JSON with tagged tensors, tuples and dicts

def enc(x):
    if isinstance(x, torch.Tensor):
        return {"tensor": x.tolist(), "dtype": str(x.dtype).removeprefix("torch.")}
    if isinstance(x, tuple):
        return {"tuple": [enc(v) for v in x]}
    if isinstance(x, dict):
        return {"dict": {k: enc(v) for k, v in x.items()}}
    if isinstance(x, list):
        return [enc(v) for v in x]
    if isinstance(x, (np.integer, np.bool_)):
        return x.item()
    return x


def dec(x):
    if isinstance(x, list):
        return [dec(v) for v in x]
    if isinstance(x, dict):
        if "tensor" in x:
            return torch.tensor(x["tensor"], dtype=getattr(torch, x["dtype"]))
        if "tuple" in x:
            return tuple(dec(v) for v in x["tuple"])
        return {k: dec(v) for k, v in x["dict"].items()}
    return x


def snapshot_path(unit: dict) -> Path:
    return SNAPSHOTS / f"unit{unit['n']}-{unit['name']}.json"


def load_snapshot(unit: dict) -> dict:
    return dec(json.loads(snapshot_path(unit).read_text()))


# ---- comparing

def num(v) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)


VERBOSE = False  # --verbose: a failure of GAE, the loss or the aggregation shows its inputs


def fmt(x) -> str:
    """A tensor, list or number in 4 significant digits."""
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu()
        x = x.double().tolist() if x.is_floating_point() else x.tolist()
    if isinstance(x, (list, tuple)):
        return "[" + ", ".join(fmt(v) for v in x) + "]"
    return num(x)


def shown(**named) -> str:
    """'; inputs: name [..], ..' under --verbose, else ''."""
    if not VERBOSE:
        return ""
    return "; inputs: " + ", ".join(f"{k} {fmt(v)}" for k, v in named.items())


def tensor_diff(got, want: torch.Tensor, what: str, atol: float = ATOL, rtol: float = RTOL):
    """None when `got` matches `want` (NaN equals NaN), else (message, index) of the first difference."""
    if not isinstance(got, torch.Tensor):
        return f"{what} is a {type(got).__name__}, expected a tensor of shape {list(want.shape)}", None
    if got.shape != want.shape:
        return f"{what} has shape {list(got.shape)}, expected {list(want.shape)}", None
    g, w = got.detach().double().cpu(), want.double()
    ok = torch.isclose(g, w, rtol=rtol, atol=atol, equal_nan=True)
    if bool(ok.all()):
        return None
    idx = tuple(int(i) for i in torch.nonzero(~ok)[0])
    where = f" at {list(idx)}" if idx else ""
    return f"{what}{where} is {num(float(g[idx]))}, expected {num(float(w[idx]))}", idx


def close(a, b) -> bool:
    return isinstance(a, (int, float)) and not isinstance(a, bool) and \
        (math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL) or (math.isnan(a) and math.isnan(b)))


@contextlib.contextmanager
def patched(owner, name: str, value):
    old = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, old)


_ALARM = [""]  # what the running check's time limit says when it fires


def _on_alarm(*_):  # module level: the watch below knows this code and lets it run inside a student's code
    raise OutOfTime(_ALARM[0])


@contextlib.contextmanager
def time_limit(seconds: float, what: str):
    """OutOfTime after `seconds` (on systems with SIGALRM; elsewhere no limit)."""
    if not hasattr(signal, "setitimer"):
        yield
        return
    _ALARM[0] = (f"{what} did not return within {seconds:g} s (an endless loop? a search that revisits "
                 f"states?)")
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ---- what a unit's function may reach: the unit files, not the rest of the project. Some of the project
# restates a unit at more length (extras/filter_rules.py computes select_groups, extras/turn_credit.py's
# bi_level_gae with one turn is gae, extras/gspo.py's loss with one token per row is policy_loss, the tests'
# slow loops, the grader's snapshots); a student's function that calls into it passes without the work.

UNIT_FILES = {(ROOT / u["file"]).resolve() for u in UNITS if not u.get("lab")}
PROJECT_DIRS = {"engine", "extras", "tools", "tests", "course"}
GIVEN_HELPERS = {("extras/collapse.py", "mi_check")}  # beyond the unit files, a handout names it: allowed
RESTATES = {  # why a folder or file is out of reach, for the message
    "extras/filter_rules.py": "RAGEN's filter rules, which compute select_groups",
    "extras/turn_credit.py": "bi-level GAE, which is gae with one turn",
    "extras/gspo.py": "GSPO's loss, which is policy_loss with one token per row",
    "extras/gigpo.py": "GiGPO, whose normalisation is GRPO's",
    "tests": "the tests' reference loops",
    "course": "the grader and its snapshots of the reference's outputs"}


@functools.lru_cache(maxsize=None)
def project_file(filename: str) -> str | None:
    """`filename` relative to ROOT when it is this project's code outside the unit files, else None (the
    unit files, Python's library, torch, a virtual environment inside the project)."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except (ValueError, OSError):
        return None
    parts = rel.parts
    ours = (len(parts) == 1 and rel.suffix == ".py") or (len(parts) > 1 and parts[0] in PROJECT_DIRS)
    return rel.as_posix() if ours and (ROOT / rel).resolve() not in UNIT_FILES else None


def unit_callables() -> list[tuple[str, object]]:
    """(name, the function now in place) of every unit: a test's mutation or the grader's recorded `_push`
    included, as the modules hold them at this moment."""
    modules = {"envs.py": envs, "rollout.py": rollout, "advantages.py": advantages, "starpo.py": starpo,
               "filter.py": variance_filter, "monitor.py": monitor}
    out = []
    for unit in UNITS:
        for func in unit.get("funcs", []):
            owner = modules[unit["file"]]
            for part in func.split("."):  # a function renamed or deleted: its checks say so, not this
                owner = getattr(owner, part, None)
            if owner is not None:
                out.append((func, inspect.unwrap(owner)))
    return out


def unit_codes() -> set:
    return {getattr(fn, "__code__", None) for _, fn in unit_callables()} - {None}


def where_from(rel: str) -> str:
    why = RESTATES.get(rel) or RESTATES.get(rel.split("/")[0])
    return f"{rel}{f': {why}' if why else ''}"


def allowed(code, entry_file: str) -> bool:
    rel = project_file(code.co_filename)
    return rel is None or code.co_filename == entry_file or (rel, code.co_name) in GIVEN_HELPERS \
        or code is _on_alarm.__code__ or code in unit_codes()


class Watch:
    """A profile hook (sys.setprofile) over one check: the first code of the project beyond the unit files
    that a unit's function reaches, or a file it opens. A module run by an import is not watched (importing
    computes nothing of a unit)."""

    def __init__(self):
        self.codes, self.entry, self.entry_file, self.importing, self.found = set(), None, "", None, None
        self.ok = set()  # codes already allowed in this check (the recorded _push, called thousands of times)

    def hook(self, frame, event, arg):
        if event == "call":
            code = frame.f_code
            if self.entry is None:
                if code in self.codes:
                    self.entry, self.entry_file = frame, code.co_filename
            elif self.importing is None and self.found is None:
                if code.co_name == "<module>":
                    self.importing = frame
                elif code in self.ok:
                    pass
                elif allowed(code, self.entry_file):
                    self.ok.add(code)
                else:
                    rel = project_file(code.co_filename)
                    self.found = f"called {code.co_qualname} ({where_from(rel)}) while it ran"
        elif event == "return":
            if frame is self.entry:
                self.entry = None
            elif frame is self.importing:
                self.importing = None
        elif event == "c_call" and arg is builtins.open and self.entry is not None and self.importing is None:
            self.found = self.found or ("opened a file while it ran (the grader's snapshots hold the "
                                        "reference's outputs)")


@contextlib.contextmanager
def watching():
    """The Watch of one check, its hook installed around it (and the previous one, a debugger's, restored)."""
    watch = Watch()
    watch.codes = unit_codes()
    old = sys.getprofile()
    sys.setprofile(watch.hook)
    try:
        yield watch
    finally:
        sys.setprofile(old)


def referenced(fn, seen: set) -> list[str]:
    """Read with ast: what `fn`'s body names (its globals, attribute chains on them, its imports) that is this
    project's code beyond the unit files, following the helpers it names in its own file."""
    code = getattr(fn, "__code__", None)
    if code is None or code in seen:
        return []
    seen.add(code)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError, IndentationError):  # a lambda mid-line, a built-in: the watch
        return []
    found = []
    local = {}  # the names the function's own imports bind (`from extras import turn_credit` inside it)
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)) and getattr(node, "level", 0) == 0:
            for alias in node.names:
                try:
                    if isinstance(node, ast.Import):
                        top = __import__(alias.name)
                        local[alias.asname or alias.name.split(".")[0]] = \
                            __import__(alias.name, fromlist=["*"]) if alias.asname else top
                    elif node.module:
                        module = __import__(node.module, fromlist=[alias.name])
                        if hasattr(module, alias.name):
                            local[alias.asname or alias.name] = getattr(module, alias.name)
                except Exception:  # noqa: BLE001 -- an import that fails fails the student's own run, loudly
                    continue

    def check(obj, shown: str):
        target = inspect.unwrap(obj) if callable(obj) else obj
        inner = getattr(target, "__code__", None)
        if inner is None and inspect.isclass(target):
            try:
                rel = project_file(inspect.getfile(target))
            except TypeError:
                rel = None
            if rel and rel != project_file(code.co_filename):
                found.append(f"{shown} ({where_from(rel)})")
            return
        if inner is None:
            return
        if inner.co_filename == code.co_filename:
            found.extend(referenced(target, seen))  # a helper of the same file: what it names counts too
        elif not allowed(inner, code.co_filename):
            found.append(f"{shown} ({where_from(project_file(inner.co_filename))})")

    def resolve(node):
        if isinstance(node, ast.Name):
            for names in (local, fn.__globals__):
                if node.id in names:
                    return names[node.id], node.id
            return None
        if isinstance(node, ast.Attribute):
            base = resolve(node.value)
            if base is not None and hasattr(base[0], node.attr):
                return getattr(base[0], node.attr), f"{base[1]}.{node.attr}"
        return None

    for node in ast.walk(tree):
        if isinstance(node, (ast.Name, ast.Attribute)):
            hit = resolve(node)
            if hit is not None:
                check(*hit)
    for name, obj in local.items():
        check(obj, name)
    return list(dict.fromkeys(found))


def shortcut_message(func: str, what: str) -> str:
    return (f"{func} {what}: the project's code beyond the unit files is out of reach (some of it restates "
            f"the units); write the unit yourself, calling only the unit files' own helpers "
            f"(course/README.md, \"Rules\")")


class Report:
    """One unit's checks: each passes, fails with a message, or meets a stub (the function is missing)."""

    def __init__(self, unit: dict):
        self.unit, self.passed, self.total, self.stubbed = unit, 0, 0, 0
        self.failures: list[str] = []
        self.missing: list[str] = []
        self.hung: dict[str, str] = {}
        self.skipped: list[str] = []  # checks this machine cannot run, and why

    def static(self) -> None:
        """Each unit function that names the project's code beyond the unit files fails one check."""
        funcs = dict(unit_callables())
        for func in self.unit["funcs"]:
            for what in referenced(funcs.get(func), set()):
                self.total += 1
                self.failures.append(shortcut_message(func, f"names {what}"))

    def check(self, func: str, fn, seconds: float = CHECK_SECONDS, case: str | None = None) -> None:
        """fn() -> None (pass) or what is wrong, in words; `func` names the function it calls first, `case`
        the inputs (named in an exception's message)."""
        at = f"{func} ({case})" if case else func
        if func in self.hung:
            msg = self.hung[func]
        else:
            try:
                with watching() as watch, time_limit(seconds, func):
                    msg = fn()
                if watch.found:
                    msg = shortcut_message(at, watch.found)
            except NotImplementedError as e:
                stub = re.match(r"unit \d+ \(.*?\): implement (\S+) --", str(e))
                if stub:
                    if stub.group(1) not in self.missing:
                        self.missing.append(stub.group(1))
                    self.stubbed += 1
                    return
                msg = f"{at} raised NotImplementedError{raised_where(e, func)}: {e}"
            except OutOfTime as e:
                msg = self.hung[func] = str(e)
            except Exception as e:  # the student's code raised: the case, the student's line, the error
                first = (str(e).strip().splitlines() or [""])[0][:200]
                msg = f"{at} raised {type(e).__name__}{raised_where(e, func)}: {first}"
        self.total += 1
        if msg is None:
            self.passed += 1
        else:
            self.failures.append(msg)

    def result(self) -> dict:
        u = self.unit
        status = "not implemented" if self.missing else "pass" if not self.failures else "fail"
        checks = self.total + self.stubbed  # a stub's checks count, unpassed
        points = round(u["points"] * self.passed / checks, 1) if checks else 0.0
        score = f"({points:g}/{u['points']} points)"
        tally = f"{'pass' if not self.failures else 'FAIL'} {self.passed}/{self.total} {score}"
        if self.failures:
            tally += f" -- {self.failures[0]}"
        if self.missing:
            line = f"not implemented -- implement {', '.join(self.missing)} ({handout(u)})"
            line += f"; the rest: {tally}" if self.total else f" {score}"
        else:
            line = tally
        if self.skipped:
            line += f" (skipped: {'; '.join(self.skipped)})"
        return {"unit": u["n"], "name": u["name"], "status": status, "passed": self.passed,
                "total": self.total, "missing": self.missing, "failures": self.failures,
                "skipped": self.skipped, "points": points, "max_points": u["points"],
                "line": f"unit {u['n']} {u['name']}: {line}"}


def raised_where(e: BaseException, func: str) -> str:
    """' at FILE:LINE `code`' of the traceback's last frame in the file of the function that raised (the
    student's), else in the project's own files."""
    fn = dict(unit_callables()).get(func)
    own = getattr(getattr(fn, "__code__", None), "co_filename", None)
    frames = traceback.extract_tb(e.__traceback__)
    mine = [f for f in frames if f.filename == own] or \
        [f for f in frames if Path(f.filename).resolve().parent == ROOT or project_file(f.filename)]
    if not mine:
        return ""
    f = mine[-1]
    line = (f.line or "").strip()
    shown = f" `{line[:80]}{'...' if len(line) > 80 else ''}`" if line else ""
    return f" at {Path(f.filename).name}:{f.lineno}{shown}"


# ---- unit 1: envs.py (_push, sokoban_bfs, SokobanEnv._apply)

HAND_ROOMS = {  # gym-sokoban's symbols: # wall, _ floor, O target, X box, √ box on a target, P player
    "a solved room": ["######", "#P___#", "#_√__#", "#____#", "#____#", "######"],
    "a room whose box is stuck in a corner": ["######", "#X___#", "#_P__#", "#___O#", "#____#", "######"],
    "a room with two boxes side by side": ["######", "#____#", "#PXX_#", "###OO#", "######", "######"],
}
ROOM_SEEDS = [(seed, {}) for seed in envs.EVAL_SEEDS[:3]] + [(envs.EVAL_SEEDS[2], {"num_boxes": 2})]


def room_from_rows(name: str, rows: list[str]) -> dict:
    cells = "".join(rows)
    return dict(name=name, seed=None, width=len(rows[0]), floor=[c != "#" for c in cells],
                targets=[i for i, c in enumerate(cells) if c in "O√S"], player=cells.index("P"),
                boxes=[i for i, c in enumerate(cells) if c in "X√"])


def room_from_seed(seed: int, env_kw: dict) -> dict:
    env = envs.SokobanEnv(**env_kw)
    env.reset(seed)
    boxes = f"{env.num_boxes}-box " if env.num_boxes > 1 else ""
    return dict(name=f"the {boxes}room of seed {seed}", seed=seed, env_kw=env_kw, width=env.size,
                floor=list(env._floor), targets=sorted(env._targets), player=env._player,
                boxes=list(env._boxes))


def offsets(width: int) -> list[int]:
    return [dr * width + dc for dr, dc in DIRS]


def all_moves(room: dict) -> tuple[list, list]:
    """Every move from every state reachable from the start -> (moves [p, boxes, a, p2, boxes2], states)."""
    start = (room["player"], tuple(room["boxes"]))
    seen, todo, moves = {start}, [start], []
    while todo:
        p, boxes = todo.pop()
        for a, off in enumerate(offsets(room["width"])):
            p2, b2 = envs._push(room["floor"], p, boxes, off)
            moves.append([p, list(boxes), a, p2, list(b2)])
            if (p2, b2) not in seen:
                seen.add((p2, b2))
                todo.append((p2, b2))
    return moves, sorted(seen)


def move_table(room: dict) -> dict:
    offs = offsets(room["width"])
    return {(p, tuple(b), offs[a]): (p2, tuple(b2)) for p, b, a, p2, b2 in room["moves"]}


def recorded_push(table: dict):
    """A `_push` that answers from the recorded table; like the reference, a step that pushes no box returns
    the very `boxes` object it was given."""
    def push(floor, player, boxes, off):
        key = (int(player), tuple(boxes), int(off))
        if key not in table:
            raise KeyError(f"_push was asked about player {player}, boxes {tuple(boxes)}, step {off}: a "
                           f"state that cannot be reached from the start")
        p2, b2 = table[key]
        return p2, boxes if b2 == tuple(boxes) else b2
    return push


def record_unit1() -> dict:
    rng = np.random.default_rng(1)
    rooms = [room_from_seed(*s) for s in ROOM_SEEDS] + [room_from_rows(k, v) for k, v in HAND_ROOMS.items()]
    bfs, apply = [], []
    for room in rooms:
        room["moves"], states = all_moves(room)
        targets = frozenset(room["targets"])
        solved = [s for s in states if all(b in targets for b in s[1])]
        stuck = [s for s in states if envs.sokoban_bfs(room["floor"], room["width"], targets, *s) is None]
        open_ = [s for s in states if s not in stuck and s not in solved]
        # the start, two states on the way, a dead end and a solved state, where the room has them
        on_the_way = [open_[i] for i in rng.choice(len(open_), 2)] if open_ else []
        picks = [(room["player"], tuple(room["boxes"])), *on_the_way, *stuck[:1], *solved[:1]]
        for p, boxes in dict.fromkeys(picks):  # each state once
            plan = envs.sokoban_bfs(room["floor"], room["width"], frozenset(room["targets"]), p, boxes)
            bfs.append(dict(room=rooms.index(room), player=p, boxes=list(boxes),
                            fewest=None if plan is None else len(plan)))
        if room["seed"] is not None:
            for kind in ("solve", "wander"):
                apply.append(dict(room=rooms.index(room), kind=kind, steps=record_steps(room, kind, rng)))
    return dict(rooms=rooms, bfs=bfs, apply=apply)


def off_target_path(room: dict) -> list[int] | None:
    """The fewest moves from the start through a move that pushes a box off its target, if there is one."""
    on = lambda boxes: sum(b in room["targets"] for b in boxes)  # noqa: E731
    graph: dict = {}
    for p, boxes, a, p2, b2 in room["moves"]:
        graph.setdefault((p, tuple(boxes)), []).append((a, (p2, tuple(b2))))
    start = (room["player"], tuple(room["boxes"]))
    paths, todo = {start: []}, [start]
    for state in todo:  # breadth-first: todo grows while it is read
        for a, nxt in graph[state]:
            if on(nxt[1]) < on(state[1]):
                return paths[state] + [a]
            if nxt not in paths and on(nxt[1]) < len(nxt[1]):
                paths[nxt] = paths[state] + [a]
                todo.append(nxt)
    return None


def record_steps(room: dict, kind: str, rng) -> list[dict]:
    """A few random moves then the expert's plan ("solve"); or ("wander") the way to a push that takes a box
    off its target, then random moves, or without one the random walk (of 60) with the most kinds of reward:
    each step's action and the env's answer."""
    def play(words):
        env = envs.SokobanEnv(**room["env_kw"])
        env.reset(room["seed"])
        steps = []
        for w in words:
            obs, reward, done, info = env.step(w)
            steps.append(dict(action=w, obs=obs, reward=reward, done=done, info=info))
            if done:
                break
        return steps
    if kind == "solve":
        for _ in range(50):  # two random moves that leave the room solvable
            env = envs.SokobanEnv(**room["env_kw"])
            env.reset(room["seed"])
            words = [MOVES[int(a)] for a in rng.integers(4, size=2)]
            for w in words:
                env.step(w)
            plan = envs.sokoban_bfs(env._floor, env.size, env._targets, env._player, env._boxes)
            if plan:
                return play(words + [MOVES[a] for a in plan])
        raise RuntimeError(f"no solvable start found in {room['name']}")
    off = off_target_path(room)
    if off is not None:
        return play([MOVES[a] for a in off] + [MOVES[int(a)] for a in rng.integers(4, size=12)])
    walks = [play([MOVES[int(a)] for a in rng.integers(4, size=40)]) for _ in range(60)]
    return max(walks, key=lambda s: len({round(x["reward"], 1) for x in s}) * 100 + len(s))


def cell(i: int, width: int) -> str:
    return f"{i // width + 1} {i % width + 1}"


def cells(boxes, width: int) -> str:
    return "[" + ", ".join(cell(b, width) for b in boxes) + "]"


def push_story(room: dict, p: int, boxes, a: int, p2: int, b2) -> str:
    """What the rules say of this move, in words (from the expected answer)."""
    if p2 == p:
        if not room["floor"][p + offsets(room["width"])[a]]:
            return "walking into a wall: nothing moves"
        return "a push against a box with a wall or another box behind it: nothing moves"
    if list(b2) == list(boxes):
        return "a step onto free floor: the player moves, the boxes stay"
    return "a push: the player steps into the box's cell, the box one cell on (boxes: a sorted tuple)"


def check_push(room: dict):
    w, offs = room["width"], offsets(room["width"])
    for p, boxes, a, p2, b2 in room["moves"]:
        given = tuple(boxes)
        got = envs._push(room["floor"], p, given, offs[a])
        if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], tuple)):
            return f"_push must return (player, boxes) with boxes a tuple, got {got!r}"
        if got[0] != p2 or list(got[1]) != b2:
            story = push_story(room, p, boxes, a, p2, b2)
            return (f"_push: in {room['name']}, the player at {cell(p, w)} moving {MOVES[a]} with boxes at "
                    f"{cells(boxes, w)} should end at {cell(p2, w)} with boxes at {cells(b2, w)}; yours ends "
                    f"at {cell(got[0], w)} with boxes at {cells(got[1], w)} ({story})")
        if b2 == list(boxes) and got[1] is not given:
            return (f"_push: in {room['name']}, a move that pushes no box must return the same `boxes` "
                    f"object it was given (the docstring; sokoban_bfs tells a push by `is not`)")
    return None


def check_bfs(room: dict, case: dict):
    w, table = room["width"], move_table(room)
    start = (case["player"], tuple(case["boxes"]))
    where = f"sokoban_bfs: in {room['name']}, from the player at {cell(start[0], w)} and boxes at " \
            f"{cells(start[1], w)}"
    with patched(envs, "_push", recorded_push(table)):
        plan = envs.sokoban_bfs(room["floor"], w, frozenset(room["targets"]), *start)
    fewest = case["fewest"]
    if fewest is None:
        return None if plan is None else f"{where}: no plan exists (a box is stuck), so return None; you " \
                                          f"returned {plan!r}"
    if plan is None:
        return f"{where}: a plan of {fewest} moves exists, you returned None"
    if not isinstance(plan, list) or not all(isinstance(a, (int, np.integer)) and 0 <= a < 4 for a in plan):
        return f"{where}: return a list of action indices 0-3 (Up, Down, Left, Right), got {plan!r}"
    state = start
    for a in plan:
        state = table[(state[0], state[1], offsets(w)[a])]
    if not all(b in room["targets"] for b in state[1]):
        return f"{where}: your plan {[MOVES[a] for a in plan]} does not put every box on a target"
    if len(plan) != fewest:
        if fewest == 0:
            return f"{where}: every box is on a target already: return []"
        return (f"{where}: your plan takes {len(plan)} moves, the fewest is {fewest}: search breadth-first "
                f"(every plan of k moves before any of k + 1), stop at the first state that solves the room")
    return None


def apply_story(step: dict) -> str:
    r = round(step["reward"], 1)
    return {0.9: "a push that puts a box on a target", -1.1: "a push that takes a box off a target",
            10.9: "the push that solves the room"}.get(
        r, "a move that changes no target" if step["info"]["action_is_effective"] else "a move into a wall")


def check_apply(room: dict, case: dict):
    env = envs.SokobanEnv(**room["env_kw"])
    env.reset(room["seed"])
    name = f"SokobanEnv._apply: in {room['name']} ({'the expert' if case['kind'] == 'solve' else 'a walk'})"
    with patched(envs, "_push", recorded_push(move_table(room))):
        for k, want in enumerate(case["steps"], 1):
            got = env.step(want["action"])
            at = f"{name}, step {k} ({want['action']}, {apply_story(want)})"
            if not (isinstance(got, tuple) and len(got) == 4):
                return f"{at}: return (observation, reward, done, info), got {got!r}"
            obs, reward, done, info = got
            if obs != want["obs"]:
                return (f"{at}: the observation differs: update self._player and self._boxes with "
                        f"self._move, then return self._render()")
            if not close(float(reward), want["reward"]):
                return (f"{at}: the reward is {num(float(reward))}, expected {num(want['reward'])}: -0.1 a "
                        f"step, +1 / -1 when a box goes onto / off a target, +10 when every box is on one")
            if bool(done) != want["done"] or bool(env.done) != want["done"]:
                return (f"{at}: done is {bool(done)} (self.done {bool(env.done)}), expected {want['done']}: "
                        f"the episode ends, and self.done is set, exactly when every box is on a target")
            if not isinstance(info, dict) or any(info.get(key) != v for key, v in want["info"].items()):
                return (f"{at}: info is {info!r}, expected {want['info']!r}: success (every box on a "
                        f"target), action_is_valid (True), action_is_effective (the player moved)")
    return None


def grade_unit1(snap: dict, rep: Report) -> None:
    rooms = snap["rooms"]
    for room in rooms:
        rep.check("_push", lambda room=room: check_push(room), case=f"every move in {room['name']}")
    for case in snap["bfs"]:
        room = rooms[case["room"]]
        rep.check("sokoban_bfs", lambda case=case: check_bfs(rooms[case["room"]], case),
                  case=f"{room['name']}, the player at {cell(case['player'], room['width'])}")
    for case in snap["apply"]:
        walk = "the expert" if case["kind"] == "solve" else "a walk"
        rep.check("SokobanEnv._apply", lambda case=case: check_apply(rooms[case["room"]], case),
                  case=f"{rooms[case['room']]['name']}, {walk}")


# ---- unit 2: rollout.py (parse_reply, trained_mask, Segment.append)

PARSE_GROUPS = {  # (text, think, max_actions, why it parses so)
    "well-formed replies": [
        ("<think> go left </think> <answer> Left || Up </answer>", True, 5, "the answer's actions"),
        ("<think>a</think><answer>Up</answer>", True, 5, "no space is needed between the tags"),
        ("<think> a </think>\n\n<answer>Up</answer>", True, 5, "only whitespace may lie between </think> "
                                                                "and <answer>"),
        ("Sure! <think> a </think> <answer> Up </answer> Done.", True, 5, "text around the tags is ignored"),
        ("<answer> Up </answer>", False, 5, "no-think: only <answer>..</answer>"),
        ("<think> a </think> <answer> Up </answer>", False, 5, "no-think: a thought before is ignored"),
        ("<answer> Up </answer> <answer> Down </answer>", False, 5, "the first answer counts"),
        ("<think> a </think> <answer> Up </answer> <answer> Down </answer>", True, 5,
         "the first answer counts"),
        ("</answer> <answer> Up </answer>", False, 5, "</answer> is looked for after <answer>"),
        ("<think> x </think> y </think> <answer> Up </answer>", True, 5, "the </think> followed by <answer> "
                                                                          "counts"),
    ],
    "malformed replies": [
        ("<think> a <answer> Up </answer>", True, 5, "no </think>: not well-formed"),
        ("<answer> Up </answer>", True, 5, "with think, a reply without <think> is not well-formed"),
        ("<think> a </think> Up", True, 5, "no <answer>: not well-formed"),
        ("<think> a </think> <answer> Up", True, 5, "no </answer>: not well-formed"),
        ("<answer> Up", False, 5, "no </answer>: not well-formed"),
        ("<think> a </think> so <answer> Up </answer>", True, 5, "text between </think> and <answer>"),
        ("Up || Down", False, 5, "no tags at all"),
        ("<ANSWER> Up </ANSWER>", False, 5, "tags are matched exactly (case too)"),
    ],
    "splitting on ||": [
        ("<answer> Jump || Up </answer>", False, 5, "unknown words are kept: the env judges them"),
        ("<answer> A || B || C || D || E || F || G </answer>", False, 5, "the first max_actions are kept"),
        ("<answer> A || B || C </answer>", False, 2, "the first max_actions are kept"),
        ("<answer> </answer>", False, 5, "an empty answer is well-formed with no actions"),
        ("<answer> || Up |||| left ||</answer>", False, 5, "empty pieces are dropped"),
        ("<answer>\n  up||DOWN \n</answer>", False, 5, "pieces are stripped, their case kept"),
    ],
}
SOUP = ["<think>", "</think>", "<answer>", "</answer>", " ", "\n", "Up", " || ", "x", "<", ">"]
LONG_TAGS = 40_000  # a lazy regex takes minutes on this many unclosed tags; str.find, milliseconds
RULE = {True: "the first <think>, then the first </think> with only whitespace before <answer>, then the "
              "first </answer>", False: "the first <answer>, then the first </answer> after it"}
AGENT_MOVES = [["Down", "Right"], ["Right"], ["Jump", "Down"], ["Right", "Down"]]


def scripted_agent(env, actions_left, cfg):  # the grader's agent: fixed moves by turn, an unknown word too
    turn = getattr(env, "_grader_turn", 0)
    env._grader_turn = turn + 1
    return AGENT_MOVES[turn % len(AGENT_MOVES)], f"turn {turn + 1}: I try these."


ROLLOUTS = [  # (what, env, config)
    ("frozenlake, the whole conversation (think, 4 turns)", "frozenlake",
     dict(max_turns=4, max_actions_per_turn=2, max_actions=8, think=True, context_turns=0)),
    ("frozenlake, one segment per turn (no think, window 1)", "frozenlake",
     dict(max_turns=3, max_actions_per_turn=2, max_actions=6, think=False, context_turns=1)),
    ("bandit, one turn", "bandit", dict(max_turns=1, max_actions_per_turn=1, max_actions=1, think=True)),
]


def prior_tokenizer():
    from engine.models import PRIOR_DIR, tokenizer_class
    return tokenizer_class(PRIOR_DIR).from_pretrained(str(PRIOR_DIR))


def template_probe(tok) -> list[int]:
    """A short conversation as this tokenizer and transformers render it: the whole rollouts are compared only
    where it matches the recording's (another transformers may render the chat template otherwise)."""
    msgs = [{"role": "system", "content": rollout.SYSTEM_PROMPT}, {"role": "user", "content": "Turn 1:\nX"},
            {"role": "assistant", "content": "<think> a </think> <answer> Up </answer>"},
            {"role": "user", "content": "Reward: 0\nTurn 2:"}]
    return tok(tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True),
               add_special_tokens=False)["input_ids"]


def run_rollout(tok, env: str, cfg: dict) -> list:
    trajs = rollout.rollout(env, envs.EVAL_SEEDS[:3], [0, 1, 2], rollout.RolloutConfig(**cfg), tokenizer=tok,
                            agent=scripted_agent)
    return [[dict(input_ids=s.input_ids, loss_mask=s.loss_mask, reply_ends=s.reply_ends) for s in t.segments]
            for t in trajs]


def recorded_parse(calls: list):
    """A `parse_reply` that answers from the reference's recorded calls: the whole rollouts check
    Segment.append even while the parser is wrong."""
    table = {(text, think, k): (actions, parsed) for text, think, k, actions, parsed in calls}

    def parse(text, think, max_actions):
        if (text, think, max_actions) not in table:
            raise KeyError(f"rollout asked parse_reply about a reply the reference never saw: {text[:60]!r}")
        actions, parsed = table[(text, think, max_actions)]
        return list(actions), parsed
    return parse


APPEND_CASES = [  # (start ids, its system length, [(ids, sampled, logp or None)])
    ([1, 2, 3, 4], 2, [([5, 6, 7], 1, [-0.5, -0.25, -1.0]), ([8, 9], 0, None), ([10, 11], 1, [-0.1, -0.2])]),
    ([1, 2], 1, [([3], 1, None), ([], 1, None), ([4, 5, 6], 0, None), ([7], 1, [-2.0])]),
    ([9], 0, [([], 0, None), ([4, 4], 0, None), ([5], 1, [-0.75]), ([6, 7, 8, 9], 1, [-1, -2, -3, -4])]),
]
MASK_CASES = [  # (input_ids, loss_mask, system_len)
    ([1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 1, 1, 0, 1, 0], 2),
    ([1, 2, 3, 4, 5], [0, 0, 0, 0, 1], 4),
    ([1, 2, 3, 4], [0, 1, 1, 0], 0),
]


def record_unit2() -> dict:
    rng = np.random.default_rng(2)
    groups = {g: [(t, th, k, why, rollout.parse_reply(t, th, k)) for t, th, k, why in cases]
              for g, cases in PARSE_GROUPS.items()}
    soups = ["".join(SOUP[i] for i in rng.integers(len(SOUP), size=int(rng.integers(0, 15))))
             for _ in range(400)]
    groups["random tag soups"] = [(t, th, 3, None, rollout.parse_reply(t, th, 3))
                                  for t in soups for th in (True, False)]
    appends = []
    for ids, sys_len, ops in APPEND_CASES:
        seg = rollout.Segment(list(ids), [0] * len(ids), sys_len)
        for op in ops:
            seg.append(list(op[0]), op[1], op[2])
        appends.append(dict(start=ids, system_len=sys_len, ops=ops, input_ids=seg.input_ids,
                            loss_mask=seg.loss_mask, logp=seg.logp, reply_ends=seg.reply_ends))
    masks = []
    for ids, mask, sys_len in MASK_CASES:
        seg = rollout.Segment(ids, mask, sys_len)
        masks.append(dict(ids=ids, mask=mask, system_len=sys_len, on=rollout.trained_mask(seg, True),
                          off=rollout.trained_mask(seg, False)))
    tok = prior_tokenizer()
    calls, parse = [], rollout.parse_reply

    def recording(text, think, max_actions):
        calls.append([text, think, max_actions, *parse(text, think, max_actions)])
        return parse(text, think, max_actions)
    with patched(rollout, "parse_reply", recording):
        rollouts = [dict(what=what, env=env, cfg=cfg, segments=run_rollout(tok, env, cfg))
                    for what, env, cfg in ROLLOUTS]
    return dict(parse=groups, appends=appends, masks=masks, rollouts=rollouts, rollout_parses=calls,
                probe=template_probe(tok))


def check_parse(cases: list):
    for text, think, k, why, want in cases:
        got = rollout.parse_reply(text, think, k)
        ok = isinstance(got, tuple) and len(got) == 2 and list(got[0]) == list(want[0]) and got[1] == want[1]
        if not ok:
            shown = text if len(text) <= 80 else text[:77] + "..."
            return (f"parse_reply({shown!r}, think={think}, max_actions={k}) returned {got!r}, expected "
                    f"{tuple(want)!r}: {why or RULE[think]}")
    return None


def check_parse_long():
    text = "<think>" * LONG_TAGS + "</think> <answer> Up </answer>"
    try:
        got = rollout.parse_reply(text, True, 5)
    except OutOfTime:
        return (f"parse_reply took over 5 s on a reply of {LONG_TAGS} unclosed <think> tags: find the tags "
                f"with str.find (a lazy regex is quadratic here)")
    if got != (["Up"], True):
        return f"parse_reply on {LONG_TAGS} <think> tags and an answer returned {got!r}, not (['Up'], True)"
    return None


def check_mask(case: dict, response_mask: bool):
    seg = rollout.Segment(list(case["ids"]), list(case["mask"]), case["system_len"])
    got = rollout.trained_mask(seg, response_mask)
    want = case["on" if response_mask else "off"]
    if list(got) != want:
        why = ("the tokens the policy sampled: seg.loss_mask, no template, state or feedback token"
               if response_mask else "every token after the system message (system_len tokens), states too")
        return (f"trained_mask(response_mask={response_mask}) of a segment with loss_mask {case['mask']} and "
                f"system_len {case['system_len']} returned {list(got)}, expected {want}: {why}")
    return None


def check_mask_unknown_system():
    seg = rollout.Segment([1, 2, 3], [0, 1, 1], -1)
    try:
        got = rollout.trained_mask(seg, False)
    except ValueError:
        return None
    return (f"trained_mask(response_mask=False) with system_len -1 (the template renders no system message "
            f"alone) returned {got!r}: raise ValueError, where the system message ends is unknown")


def check_append(case: dict):
    seg = rollout.Segment(list(case["start"]), [0] * len(case["start"]), case["system_len"])
    for ids, sampled, logp in case["ops"]:
        seg.append(list(ids), sampled, None if logp is None else list(logp))
    calls = " then ".join(f"append({ids}, {s}{'' if lp is None else ', logp'})" for ids, s, lp in case["ops"])
    start = f"Segment.append: from input_ids {case['start']}, {calls}"
    if list(seg.input_ids) != case["input_ids"]:
        return f"{start}: input_ids is {list(seg.input_ids)}, expected {case['input_ids']}"
    if list(seg.loss_mask) != case["loss_mask"]:
        return (f"{start}: loss_mask is {list(seg.loss_mask)}, expected {case['loss_mask']}: `sampled` "
                f"(1 or 0) once per appended token; a token the policy did not sample is never trained")
    logp = [float(x) for x in seg.logp]
    if len(logp) != len(case["logp"]) or not all(close(a, b) for a, b in zip(logp, case["logp"])):
        return f"{start}: logp is {logp}, expected {case['logp']}: the log-probs given, else NaN per token"
    if list(seg.reply_ends) != case["reply_ends"]:
        return (f"{start}: reply_ends is {list(seg.reply_ends)}, expected {case['reply_ends']}: the index of "
                f"each sampled reply's last token (len(input_ids) - 1 after appending it), none for an empty "
                f"one")
    return None


def check_rollout(tok, case: dict, parses: list):
    with patched(rollout, "parse_reply", recorded_parse(parses)):
        got = run_rollout(tok, case["env"], case["cfg"])
    for i, (g_traj, w_traj) in enumerate(zip(got, case["segments"])):
        if len(g_traj) != len(w_traj):
            return f"rollout on {case['what']}: episode {i} has {len(g_traj)} segments, not {len(w_traj)}"
        for j, (g, w) in enumerate(zip(g_traj, w_traj)):
            at = f"rollout on {case['what']} (Segment.append in the episode loop): episode {i}, segment {j}"
            if list(g["input_ids"]) != w["input_ids"]:
                return f"{at}: input_ids differ from the reference's (append every id as given)"
            if list(g["loss_mask"]) != w["loss_mask"]:
                t = next(t for t, (a, b) in enumerate(zip(g["loss_mask"], w["loss_mask"])) if a != b)
                what = "a token the agent sampled" if w["loss_mask"][t] else "a template, state or env token"
                got_t, want_t = g["loss_mask"][t], w["loss_mask"][t]
                return f"{at}: loss_mask at token {t} is {got_t}, not {want_t} ({what})"
            if list(g["reply_ends"]) != w["reply_ends"]:
                return (f"{at}: reply_ends is {list(g['reply_ends'])}, expected {w['reply_ends']} (each "
                        f"turn's last sampled token)")
    return None


_TOKENIZER = []


def grade_unit2(snap: dict, rep: Report) -> None:
    for group, cases in snap["parse"].items():
        rep.check("parse_reply", lambda cases=cases: check_parse(cases), case=group)
    rep.check("parse_reply", check_parse_long, seconds=5, case=f"{LONG_TAGS} unclosed <think> tags")
    for k, case in enumerate(snap["masks"]):
        for on in (True, False):
            rep.check("trained_mask", lambda case=case, on=on: check_mask(case, on),
                      case=f"segment {k + 1}, response_mask={on}")
    rep.check("trained_mask", check_mask_unknown_system, case="system_len -1")
    for k, case in enumerate(snap["appends"]):
        rep.check("Segment.append", lambda case=case: check_append(case), case=f"append sequence {k + 1}")
    if not _TOKENIZER:  # loaded once: tests grade this unit many times
        _TOKENIZER.append(prior_tokenizer())
    tok, parses = _TOKENIZER[0], snap["rollout_parses"]
    if template_probe(tok) != snap["probe"]:
        rep.skipped.append(f"{len(snap['rollouts'])} whole rollouts: this transformers renders the chat "
                           f"template otherwise than the one that recorded the snapshots")
        return
    for case in snap["rollouts"]:
        rep.check("Segment.append", lambda case=case: check_rollout(tok, case, parses),
                  case=f"rollout on {case['what']}")


# ---- unit 3: advantages.py (grpo_advantages, gae)

def turn_mask(rows: list[list[tuple[int, int]]], T: int) -> torch.Tensor:
    """A [B, T] mask with 1 on each row's (start, end) spans: the turns' replies; between them, env text."""
    mask = torch.zeros(len(rows), T)
    for i, spans in enumerate(rows):
        for a, b in spans:
            mask[i, a:b] = 1
    return mask


def record_unit3() -> dict:
    g = torch.Generator().manual_seed(3)
    grpo = []

    def add_grpo(name, scores, ids, hint, **kw):
        out = advantages.grpo_advantages(scores, ids, **kw)
        grpo.append(dict(name=name, scores=scores, ids=ids, kw=kw, want=out, hint=hint))
    two = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.15, 0.15, 1.0, 0.0])
    ids = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    add_grpo("two groups of 4", two, ids, "(score - group mean) / (the group's unbiased std, n - 1, + eps)")
    add_grpo("Dr.GRPO (norm_by_std=False)", two, ids, "norm_by_std=False: score - group mean, no division",
             norm_by_std=False)
    add_grpo("a group of two", torch.tensor([3.0, 1.0]), torch.tensor([5, 5]),
             "the unbiased std of two scores is |a - b| / sqrt(2)")
    add_grpo("interleaved ids (a list of strings)", torch.tensor([1.0, 2.0, 4.0, 0.0, 3.0]),
             ["b", "a", "b", "a", "c"], "groups are the equal ids, wherever they sit; a group of one gets 0")
    add_grpo("a group of one and a zero-std group", torch.tensor([0.5, 1.0, 1.0, 1.0, 2.0, 0.0]),
             torch.tensor([9, 3, 3, 3, 7, 7]), "a group of one gets 0; a zero-std group: 0 / (0 + eps) = 0")
    add_grpo("a group of one, Dr.GRPO", torch.tensor([0.5, 1.0, 2.0]), torch.tensor([9, 3, 3]),
             "a group of one gets 0", norm_by_std=False)
    add_grpo("eps=0.5", torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.tensor([0, 0, 0, 0]),
             "eps is added to the std, not to the variance", eps=0.5)
    add_grpo("integer scores", torch.tensor([2, 0, 1, 1]), torch.tensor([0, 0, 1, 1]),
             "the result is float, whatever the scores' dtype")
    add_grpo("16 groups of 8", torch.randn(128, generator=g), torch.arange(16).repeat_interleave(8),
             "(score - group mean) / (unbiased std + eps)")
    add_grpo("no scores", torch.zeros(0), torch.zeros(0, dtype=torch.long), "an empty batch: an empty result")
    gae = []
    one = turn_mask([[(2, 10)], [(0, 10)], [(6, 10)]], 10)  # one turn each, to the end of the row
    one_r = advantages.place_reward_on_last_token(torch.tensor([1.0, -0.5, 2.0]), one)
    one_v = torch.randn(3, 10, generator=g) * 0.5
    turns = turn_mask([[(1, 4), (6, 9), (11, 13)], [(0, 5)], [], [(2, 3), (5, 12)]], 14)  # env text between
    rewards = advantages.place_reward_on_last_token(torch.tensor([2.0, -1.0, 0.0, 10.9]), turns)
    rewards[0, 8] = 0.5  # a turn's own reward on its last token
    values = torch.randn(4, 14, generator=g) * 0.5

    def add_gae(name, r, v, m, gamma, lam, hint):
        adv, ret = advantages.gae(r, v, m, gamma, lam)
        gae.append(dict(name=name, rewards=r, values=v, mask=m, gamma=gamma, lam=lam, adv=adv, ret=ret,
                        hint=hint))
    recursion = "delta_t = r_t + gamma * V_next - V_t; A_t = delta_t + gamma * lam * A_next"
    skip = ("the chain skips tokens off the mask: V_next and A_next belong to the next SAMPLED token, after "
            "the env's message; the last sampled token has V_next = A_next = 0")
    add_gae("one turn, values 0", one_r, torch.zeros(3, 10), one, 1.0, 1.0,
            "with gamma = lam = 1 and V = 0 every sampled token's advantage is the reward R")
    add_gae("one turn", one_r, one_v, one, 1.0, 1.0, recursion)
    add_gae("one turn, a discount", one_r, one_v, one, 0.9, 1.0,
            f"check the discount in the recursion: {recursion}")
    add_gae("one turn, lam below 1", one_r, one_v, one, 1.0, 0.8, f"check lam in the recursion: {recursion}")
    add_gae("three turns", rewards, values, turns, 0.9, 0.95, skip)
    add_gae("three turns, gamma = lam = 1", rewards, values, turns, 1.0, 1.0, skip)
    add_gae("three turns, lam = 0 (one-step TD)", rewards, values, turns, 0.9, 0.0,
            f"lam = 0: A_t = delta_t; {skip}")
    nan_values = values.masked_fill(turns == 0, float("nan"))
    add_gae("three turns, NaN values off the mask", rewards, nan_values, turns, 0.95, 0.9,
            "values off the mask (here NaN) must never enter the chain: select with torch.where")
    return dict(grpo=grpo, gae=gae)


def grpo_call(case: dict):
    ids = case["ids"] if isinstance(case["ids"], list) else case["ids"].clone()
    return advantages.grpo_advantages(case["scores"].clone(), ids, **case["kw"])


def check_grpo(case: dict):
    diff = tensor_diff(grpo_call(case), case["want"], "the advantage")
    if diff is None:
        return None
    msg, idx = diff
    ids = case["ids"] if isinstance(case["ids"], list) else case["ids"].tolist()
    group = f" (score {num(float(case['scores'][idx[0]]))}, group {ids[idx[0]]!r})" if idx else ""
    return f"grpo_advantages ({case['name']}): {msg}{group}; {case['hint']}"


def check_grpo_properties(case: dict):
    """Each group of the student's result: mean 0; unbiased std 1 (norm_by_std); shifting a group changes
    nothing."""
    adv = grpo_call(case).double()
    ids = case["ids"]
    for gid in ids.unique():
        a = adv[ids == gid]
        if abs(float(a.mean())) > 1e-5 or abs(float(a.std()) - 1) > 1e-3:
            return (f"grpo_advantages ({case['name']}): group {int(gid)}'s advantages have mean "
                    f"{float(a.mean()):.3g} and std {float(a.std()):.4g}; normalised, they have mean 0 and "
                    f"unbiased std 1 (up to eps)")
    shifted = dict(case, scores=case["scores"] + 5.0 * (case["ids"] % 2))
    if tensor_diff(grpo_call(shifted), case["want"], "") is not None:
        return (f"grpo_advantages ({case['name']}): adding 5 to every score of some groups changed the "
                f"advantages; each group is centred on its own mean")
    return None


def check_gae(case: dict):
    r, v, m = case["rewards"].clone(), case["values"].clone(), case["mask"].clone()
    got = advantages.gae(r, v, m, case["gamma"], case["lam"])
    if not (isinstance(got, tuple) and len(got) == 2):
        return f"gae must return (advantages, returns), got a {type(got).__name__}"
    at = f"gae with gamma={case['gamma']}, lam={case['lam']} ({case['name']})"
    diff = tensor_diff(got[0], case["adv"], "the advantage")
    if diff is not None:
        msg, idx = diff
        if idx:
            b, t = idx
            k = int(case["mask"][b, :t + 1].sum())
            msg = msg.replace(f" at {list(idx)}", f" of row {b}, token {t}" +
                              (f" (its sampled token {k})" if case["mask"][b, t] else " (off the mask: 0)"))
            msg += shown(row=b, rewards=case["rewards"][b], values=case["values"][b], mask=case["mask"][b],
                         yours=got[0][b], expected=case["adv"][b])
        return f"{at}: {msg}; {case['hint']}"
    if not isinstance(got[1], torch.Tensor) or got[1].shape != case["ret"].shape:
        return f"{at}: returns must be a tensor of shape {list(case['ret'].shape)}"
    m = case["mask"] > 0  # returns off the mask are never used
    diff = tensor_diff(torch.where(m, got[1].detach().float(), 0.0), torch.where(m, case["ret"], 0.0),
                       "the return")
    if diff is not None:
        return f"{at}: {diff[0]}; returns = advantages + values (the critic's targets)"
    return None


def check_gae_rejects_misplaced_rewards():
    mask = turn_mask([[(1, 3)]], 5)
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0, 2.0]])  # a reward on token 4, off the mask
    try:
        advantages.gae(rewards, torch.zeros(1, 5), mask)
    except ValueError:
        return None
    return ("gae accepted a reward on a token off the mask: raise ValueError (rewards sit on sampled tokens, "
            "see place_reward_on_last_token)")


def check_gae_property():
    """gamma = lam = 1, V = 0: every sampled token's advantage is the row's total reward."""
    mask = turn_mask([[(0, 3), (5, 8)], [(2, 7)]], 9)
    rewards = advantages.place_reward_on_last_token(torch.tensor([1.5, -0.5]), mask)
    rewards[0, 2] = 0.25
    adv, _ = advantages.gae(rewards, torch.zeros(2, 9), mask, 1.0, 1.0)
    want = rewards.flip(1).cumsum(1).flip(1) * mask  # the rewards from each token on
    diff = tensor_diff(adv, want, "the advantage")
    return None if diff is None else (f"gae with gamma = lam = 1 and values 0: {diff[0]}; then every sampled "
                                      f"token's advantage is the sum of the rewards from it on")


def check_gae_no_grad():
    """Values that require grad (a critic's output) give advantages and returns that do not: no gradient
    flows through them into the critic."""
    mask = turn_mask([[(0, 3), (5, 8)], [(2, 7)]], 9)
    rewards = advantages.place_reward_on_last_token(torch.tensor([1.5, -0.5]), mask)
    values = torch.linspace(-1, 1, 18).reshape(2, 9).requires_grad_(True)
    adv, ret = advantages.gae(rewards, values, mask, 0.9, 0.95)
    for name, x in (("advantages", adv), ("returns", ret)):
        if isinstance(x, torch.Tensor) and x.requires_grad:
            return (f"gae with values that require grad (a critic's): the {name} require grad too; compute "
                    f"them under torch.no_grad(): they are constants of the policy's loss (and the critic's "
                    f"targets), so no gradient may flow through them into the critic")
    return None


def grade_unit3(snap: dict, rep: Report) -> None:
    for case in snap["grpo"]:
        rep.check("grpo_advantages", lambda case=case: check_grpo(case), case=case["name"])
    many = next(c for c in snap["grpo"] if c["name"] == "16 groups of 8")
    rep.check("grpo_advantages", lambda: check_grpo_properties(many), case="mean 0, std 1")
    for case in snap["gae"]:
        rep.check("gae", lambda case=case: check_gae(case), case=case["name"])
    rep.check("gae", check_gae_property, case="gamma = lam = 1, values 0")
    rep.check("gae", check_gae_rejects_misplaced_rewards, case="a reward off the mask")
    rep.check("gae", check_gae_no_grad, case="values that require grad")


# ---- unit 4: starpo.py (aggregate, policy_loss, kl_penalty)

METRICS = ("pg_clipfrac", "pg_clipfrac_upper", "pg_clipfrac_lower", "approx_kl", "pg_clipfrac_dual")


def loss_inputs(g: torch.Generator, B: int, T: int, spans) -> dict:
    mask = turn_mask(spans, T)
    old = -torch.rand(B, T, generator=g) * 3
    step = (torch.rand(B, T, generator=g) - 0.5) * 1.2  # log-ratios in [-0.6, 0.6]: both clip sides
    adv = torch.randn(B, T, generator=g)
    return dict(logp=old + step, old_logp=old, advantages=adv, mask=mask)


def record_unit4() -> dict:
    g = torch.Generator().manual_seed(4)
    ragged = [[(0, 3), (5, 10)], [(1, 2)], [], [(0, 12)]]
    x = loss_inputs(g, 4, 12, ragged)
    agg = []
    modes = [  # (name, keywords, hint)
        ("token-mean", dict(agg="token-mean"), "token-mean: the sum over all sampled tokens / their count"),
        ("seq-mean-token-mean", dict(agg="seq-mean-token-mean"),
         "each row's token mean, then the mean over rows that have tokens"),
        ("seq-mean-token-sum", dict(agg="seq-mean-token-sum"),
         "each row's token sum, then the mean over rows that have tokens"),
        ("token-mean, denom 7", dict(agg="token-mean", denom=7.0), "with denom: the sum / denom"),
        ("seq-mean-token-mean, denom 3", dict(agg="seq-mean-token-mean", denom=3.0),
         "with denom: the sum of the row means / denom")]
    for name, kw, hint in modes:
        loss = torch.randn(4, 12, generator=g)
        agg.append(dict(name=name, loss=loss, mask=x["mask"], kw=kw, hint=hint,
                        want=starpo.aggregate(loss, x["mask"], **kw)))
    junk = torch.randn(4, 12, generator=g).masked_fill(x["mask"] == 0, float("inf"))
    agg.append(dict(name="inf off the mask", loss=junk, mask=x["mask"], kw={},
                    hint="a token off the mask never counts, even inf: select with torch.where, do not "
                         "multiply by the mask",
                    want=starpo.aggregate(junk, x["mask"])))
    agg.append(dict(name="no sampled token", loss=junk[:1, :4] * 0 + 1, mask=torch.zeros(1, 4), kw={},
                    hint="no sampled token: 0 (divide by the count clamped to at least 1)",
                    want=starpo.aggregate(junk[:1, :4] * 0 + 1, torch.zeros(1, 4))))
    pl = []

    def add_pl(name, inp, hint, **kw):
        logp = inp["logp"].clone().requires_grad_(True)
        loss, metrics = starpo.policy_loss(logp, inp["old_logp"], inp["advantages"], inp["mask"], **kw)
        loss.backward()
        pl.append(dict(name=name, inputs=inp, kw=kw, loss=loss.detach(), grad=logp.grad,
                       metrics={k: float(metrics[k]) for k in METRICS}, hint=hint))
    pg = "pg_t = max(-A_t * ratio_t, -A_t * clip(ratio_t, 1 - clip_low, 1 + clip_high))"
    ratios = torch.tensor([0.6, 0.78, 0.86, 1.0, 1.1, 1.22, 1.26, 1.35])  # around both bounds of each clip
    edge = dict(logp=ratios.log().repeat(2, 1), old_logp=torch.zeros(2, 8), mask=torch.ones(2, 8),
                advantages=torch.tensor([[1.0] * 8, [-1.0] * 8]))
    add_pl("both clip sides, StarPO's 0.2/0.2", edge, pg, clip_low=0.2, clip_high=0.2)
    add_pl("both clip sides, Clip-Higher 0.2/0.28", edge, pg, clip_low=0.2, clip_high=0.28)
    add_pl("random, token-mean", x, pg)
    add_pl("random, seq-mean-token-mean", x, "aggregate pg with agg", agg="seq-mean-token-mean")
    add_pl("random, seq-mean-token-sum, denom 5", x, "aggregate pg with agg and denom",
           agg="seq-mean-token-sum", denom=5.0)
    junk_in = dict(x, old_logp=x["old_logp"].masked_fill(x["mask"] == 0, float("nan")),
                   advantages=x["advantages"].masked_fill(x["mask"] == 0, float("inf")))
    add_pl("NaN and inf off the mask", junk_in, "off the mask A = 0 and old_logp = logp (torch.where): "
           "padding never reaches the loss or its gradient")
    far = dict(x, logp=x["old_logp"] + 40 * (x["advantages"] < 0) - 40 * (x["advantages"] > 0))
    add_pl("log-ratios of +-40", far, f"clamp the log-ratio to +-{starpo.LOG_RATIO_CLAMP:g} before exp")
    big = dict(x, logp=x["old_logp"] + 1.8 * (x["advantages"] < 0))
    add_pl("dual clip 3", big, "dual_clip c: where A < 0 the loss is min(pg_t, -A * c)", dual_clip=3.0)
    kl = []
    a, b = -torch.rand(3, 7, generator=g) * 4, -torch.rand(3, 7, generator=g) * 4
    b[0, 0], b[1, 1] = a[0, 0], a[1, 1] - 30  # equal: 0; far apart: the clamps
    k3 = "k3 = r - log r - 1 with r = pi_ref / pi = exp(ref_logp - logp), log r clamped to +-20, k3 to +-10"
    for kind, hint in [("k1", "k1 = logp - ref_logp"), ("k3", k3)]:
        kl.append(dict(kind=kind, logp=a, ref=b, want=starpo.kl_penalty(a, b, kind), hint=hint))
    kl.append(dict(kind=None, logp=b, ref=a, want=starpo.kl_penalty(b, a), hint="the default kind is k3"))
    return dict(agg=agg, pl=pl, kl=kl, pl_constants=no_gradient_reaches(starpo.policy_loss) is None)


# ---- unit 4's properties: no reference output needed, so a student's result is compared with itself

def clean_loss_inputs() -> dict:
    """A ragged batch whose padding is benign: A = 0 and old_logp = logp off the mask."""
    g = torch.Generator().manual_seed(41)  # its own stream: the recorded cases' inputs stay as they were
    x = loss_inputs(g, 3, 10, [[(0, 4), (6, 9)], [(2, 5)], [(0, 10)]])
    m = x["mask"] > 0
    return dict(x, old_logp=torch.where(m, x["old_logp"], x["logp"]),
                advantages=torch.where(m, x["advantages"], 0.0))


def no_gradient_reaches(policy_loss) -> str | None:
    """The name of the constant input (advantages, old_logp) that a gradient reaches, or None."""
    x = clean_loss_inputs()
    logp, old, adv = (x[k].clone().requires_grad_(True) for k in ("logp", "old_logp", "advantages"))
    loss, _ = policy_loss(logp, old, adv, x["mask"])
    loss.backward()
    return next((name for name, t in (("advantages", adv), ("old_logp", old))
                 if t.grad is not None and bool(t.grad.any())), None)


def loss_run(x: dict, kw: dict) -> tuple:
    logp = x["logp"].clone().requires_grad_(True)
    loss, metrics = starpo.policy_loss(logp, x["old_logp"].clone(), x["advantages"].clone(),
                                       x["mask"].clone(), **kw)
    loss.backward()
    return loss.detach(), logp.grad if logp.grad is not None else torch.zeros(0), metrics


def check_loss_padding():
    """NaN or large values off the mask change nothing: not the loss, its gradient or a metric."""
    clean = clean_loss_inputs()
    off = clean["mask"] == 0
    junks = [("NaN advantages", dict(advantages=clean["advantages"].masked_fill(off, float("nan")))),
             ("advantages of 1e6 and log-ratios of 3", dict(
                 advantages=clean["advantages"].masked_fill(off, 1e6),
                 old_logp=torch.where(off, clean["logp"] - 3.0, clean["old_logp"])))]
    for kw in ({}, dict(agg="seq-mean-token-sum", dual_clip=3.0)):
        want_loss, want_grad, want_metrics = loss_run(clean, kw)
        for what, junk in junks:
            x = dict(clean, **junk)
            loss, grad, metrics = loss_run(x, kw)
            at = f"policy_loss ({what} off the mask{', ' + str(kw) if kw else ''})"
            why = ("off the mask set A = 0 and old_logp = logp.detach() first (torch.where): the "
                   "aggregation's mask is not enough, NaN * 0 is NaN, in the gradient too")
            for diff in (tensor_diff(loss, want_loss, "the loss"),
                         tensor_diff(grad, want_grad, "d loss / d logp")):
                if diff is not None:
                    return (f"{at}: {diff[0]}, with the padding zeroed; {why}" +
                            shown(logp=x["logp"], old_logp=x["old_logp"], advantages=x["advantages"],
                                  mask=x["mask"]))
            for k in METRICS:
                got, want = metrics.get(k), want_metrics.get(k)
                if got is not None and want is not None and not close(float(got), float(want)):
                    return (f"{at}: metrics['{k}'] is {num(float(got))}, with the padding zeroed "
                            f"{num(float(want))}; {why}")
    return None


def check_loss_bf16():
    """bf16 log-probs (a bf16 model's) give a float32 loss, the loss of the same values in float32."""
    x = clean_loss_inputs()
    logp, old = x["logp"].bfloat16(), x["old_logp"].bfloat16()
    got, _ = starpo.policy_loss(logp.clone().requires_grad_(True), old, x["advantages"], x["mask"])
    want, _ = starpo.policy_loss(logp.float().requires_grad_(True), old.float(), x["advantages"], x["mask"])
    if not isinstance(got, torch.Tensor) or got.dtype != torch.float32:
        return (f"policy_loss on bfloat16 logp and old_logp returned a {getattr(got, 'dtype', type(got))} "
                f"loss, expected float32: work in float32 (.float() on the inputs first)")
    diff = tensor_diff(got, want.detach(), "the loss")
    return None if diff is None else (f"policy_loss on bfloat16 logp and old_logp: {diff[0]} (your loss of "
                                      f"the same values in float32); compute in float32 (.float() first): "
                                      f"bf16 keeps 3 digits, so its ratios near 1 are off by up to 0.4%")


def check_loss_constants():
    """No gradient reaches advantages or old_logp: they are constants of the loss."""
    name = no_gradient_reaches(starpo.policy_loss)
    return None if name is None else (
        f"policy_loss with {name} that require grad: a gradient reached {name}; they are constants of the "
        f"loss (detach them), so that the policy's update never trains what computed them (a critic, "
        f"through GAE)")


def check_kl_bf16():
    """bf16 log-probs give a float32 KL equal to the KL of the same values in float32."""
    g = torch.Generator().manual_seed(42)
    logp = (-torch.rand(2, 8, generator=g) * 3).bfloat16()
    step = torch.cat([torch.randn(1, 8, generator=g) * 0.02, torch.randn(1, 8, generator=g)])  # near 1, far
    ref = (logp.float() + step).bfloat16()
    for kind in ("k1", "k3"):
        got = starpo.kl_penalty(logp.clone(), ref.clone(), kind)
        if not isinstance(got, torch.Tensor) or got.dtype != torch.float32:
            return (f"kl_penalty(kind={kind}) on bfloat16 logp and ref_logp returned "
                    f"{getattr(got, 'dtype', type(got))}, expected float32: .float() the inputs first")
        want = starpo.kl_penalty(logp.float(), ref.float(), kind)
        diff = tensor_diff(got, want, "the KL")
        if diff is not None:
            msg, idx = diff
            return (f"kl_penalty(kind={kind}) on bfloat16 logp and ref_logp: {msg} (your KL of the same "
                    f"values in float32; logp {num(float(logp[idx]))}, ref_logp {num(float(ref[idx]))}); "
                    f"compute in float32: in bf16, k3 = r - log r - 1 loses every digit when r is near 1")
    return None


def student_bounds(kw: dict) -> tuple[float, float] | None:
    """The ratio bounds the student's policy_loss clips to, read from its own output on one token: A = -1 at
    ratio 0.2 (far below the lower bound) loses max(r, clip(r)) = the lower bound; A = 1 at ratio 3 (far
    above the upper) loses max(-r, -clip(r)) = minus the upper bound. 0.2 and 3 mean no clip on that side."""
    def loss_at(ratio: float, adv: float) -> float:
        logp, adv_ = torch.tensor([[math.log(ratio)]]), torch.tensor([[adv]])
        loss, _ = starpo.policy_loss(logp, torch.zeros(1, 1), adv_, torch.ones(1, 1), **kw)
        return float(loss)
    try:
        return loss_at(0.2, -1.0), -loss_at(3.0, 1.0)
    except Exception:  # noqa: BLE001 -- the case's own message is shown instead
        return None


def check_aggregate(case: dict):
    got = starpo.aggregate(case["loss"].clone(), case["mask"].clone(), **case["kw"])
    diff = tensor_diff(got, case["want"], "the result")
    return None if diff is None else (f"aggregate ({case['name']}): {diff[0]}; {case['hint']}" +
                                      shown(loss_tok=case["loss"], mask=case["mask"], **case["kw"]))


def check_policy_loss(case: dict):
    x = case["inputs"]
    logp = x["logp"].clone().requires_grad_(True)
    got = starpo.policy_loss(logp, x["old_logp"].clone(), x["advantages"].clone(), x["mask"].clone(),
                             **case["kw"])
    at = f"policy_loss ({case['name']})"
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict)):
        return f"{at}: return (loss, metrics dict), got a {type(got).__name__}"
    loss, metrics = got
    inputs = shown(**{k: x[k] for k in ("logp", "old_logp", "advantages", "mask")})
    diff = tensor_diff(loss, case["loss"], "the loss")
    if diff is not None:
        return f"{at}: {diff[0]}; {clip_hint(case)}{inputs}"
    if not loss.requires_grad:
        return f"{at}: the loss has no gradient: compute it from logp (do not detach)"
    loss.backward()
    grad = logp.grad if logp.grad is not None else torch.zeros(0)
    diff = tensor_diff(grad, case["grad"], "d loss / d logp")
    if diff is not None:
        msg, idx = diff
        if idx and VERBOSE:
            b, t = idx
            inputs = shown(row=b, token=t, **{k: x[k][b] for k in ("logp", "old_logp", "advantages", "mask")})
        return (f"{at}: {msg}; a clipped token's ratio gets no gradient, a token off the mask none either "
                f"({clip_hint(case)}){inputs}")
    for k in METRICS:
        if k not in metrics or not close(float(metrics[k]), case["metrics"][k]):
            have = num(float(metrics[k])) if k in metrics else "missing"
            return (f"{at}: metrics['{k}'] is {have}, expected {num(case['metrics'][k])}; see the handout's "
                    f"table of the metrics (fractions of the sampled tokens)")
    return None


def clip_hint(case: dict) -> str:
    """The case's hint; where the student's own loss clips the ratio to other bounds than the case's, those
    bounds, read from its output (student_bounds)."""
    kw = case["kw"]
    if kw.get("dual_clip"):
        return case["hint"]
    low, high = 1 - kw.get("clip_low", 0.2), 1 + kw.get("clip_high", 0.28)
    got = student_bounds({k: v for k, v in kw.items() if k in ("clip_low", "clip_high")})
    if got is None or (close(got[0], low) and close(got[1], high)) or not 0.2 - 1e-6 <= got[0] <= 1 <= got[1]:
        return case["hint"]  # the bounds right, or no bounds to read (a ratio upside down, say)
    side = [("none" if math.isclose(v, far, rel_tol=1e-3) else num(v)) for v, far in zip(got, (0.2, 3.0))]
    return (f"your loss clips the ratio to [{side[0]}, {side[1]}] (read from your loss on one token far "
            f"below and far above both bounds); with clip_low={num(1 - low)}, clip_high={num(high - 1)} it "
            f"is [1 - clip_low, 1 + clip_high] = [{num(low)}, {num(high)}]: {case['hint']}")


def check_ratio_one():
    """At ratio 1 (logp = old_logp) the token-mean loss is minus the sampled tokens' mean advantage."""
    mask = turn_mask([[(0, 2), (4, 6)], [(1, 5)]], 6)
    adv = torch.tensor([[1.0, 2.0, 9.0, 9.0, -1.0, 0.5], [9.0, 0.25, 0.25, -2.0, 1.0, 9.0]])
    logp = torch.full((2, 6), -1.0)
    loss, _ = starpo.policy_loss(logp, logp.clone(), adv, mask)
    want = -(adv * mask).sum() / mask.sum()
    diff = tensor_diff(loss, want, "the loss")
    return None if diff is None else (f"policy_loss at ratio 1: {diff[0]}; then the loss is minus the mean "
                                      f"advantage over the sampled tokens")


def check_kl(case: dict):
    args = () if case["kind"] is None else (case["kind"],)
    got = starpo.kl_penalty(case["logp"].clone(), case["ref"].clone(), *args)
    diff = tensor_diff(got, case["want"], "the KL")
    if diff is None:
        return None
    msg, idx = diff
    vals = f" (logp {num(float(case['logp'][idx]))}, ref_logp {num(float(case['ref'][idx]))})" if idx else ""
    return f"kl_penalty(kind={case['kind'] or 'default'}): {msg}{vals}; {case['hint']}"


def check_kl_properties():
    logp = torch.tensor([[-0.1, -2.0, -0.7, -3.0]])
    ref = torch.tensor([[-0.1, -0.5, -1.4, -0.2]])
    k3 = starpo.kl_penalty(logp, ref, "k3")
    if not isinstance(k3, torch.Tensor) or k3.shape != logp.shape:
        return "kl_penalty must return a per-token tensor of logp's shape"
    if float(k3[0, 0]) != 0 or bool((k3 < 0).any()):
        return f"kl_penalty k3 is {k3.tolist()}: it is 0 where logp = ref_logp and never negative"
    return None


def grade_unit4(snap: dict, rep: Report) -> None:
    for case in snap["agg"]:
        rep.check("aggregate", lambda case=case: check_aggregate(case), case=case["name"])
    for case in snap["pl"]:
        rep.check("policy_loss", lambda case=case: check_policy_loss(case), case=case["name"])
    rep.check("policy_loss", check_ratio_one, case="ratio 1")
    rep.check("policy_loss", check_loss_padding, case="junk off the mask")
    rep.check("policy_loss", check_loss_bf16, case="bfloat16 log-probs")
    if snap["pl_constants"]:  # the reference's own contract: graded where the reference keeps it
        rep.check("policy_loss", check_loss_constants, case="advantages that require grad")
    for case in snap["kl"]:
        rep.check("kl_penalty", lambda case=case: check_kl(case), case=f"kind={case['kind'] or 'default'}")
    rep.check("kl_penalty", check_kl_properties, case="k3 >= 0")
    rep.check("kl_penalty", check_kl_bf16, case="bfloat16 log-probs")


# ---- unit 5: filter.py (select_groups)

def record_unit5() -> dict:
    g = torch.Generator().manual_seed(5)
    cases = []

    def add(name, rewards, hint, **kw):
        mask, stats = variance_filter.select_groups(rewards, **kw)
        cases.append(dict(name=name, rewards=rewards, kw=kw, mask=mask, stats=stats, hint=hint))
    bandit = torch.where(torch.rand(8, 16, generator=g) < torch.linspace(0.05, 0.6, 8).unsqueeze(1),
                         torch.tensor(1.0), torch.tensor(0.15)) * (torch.rand(8, 16, generator=g) < 0.9)
    rank = "rank the groups by the unbiased std of their rewards (std over dim 1), largest first"
    add("8 groups of 16, keep 0.25", bandit, rank)
    add("8 groups of 16, keep 0.25, largest=False", bandit, "largest=False keeps the SMALLEST stds",
        largest=False)
    add("7 groups, keep 0.5", torch.randn(7, 4, generator=g), "keep int(keep * G) groups: int(3.5) = 3, "
                                                              "not round", keep=0.5)
    add("8 groups, keep 0.05", torch.randn(8, 4, generator=g),
        "keep at least one group: max(1, int(keep * G))", keep=0.05)
    add("keep 1.0", torch.randn(5, 3, generator=g), "keep = 1 keeps every group", keep=1.0)
    ties = torch.tensor([[0.0, 1.0], [2.0, 2.0], [5.0, 6.0], [1.0, 0.0], [3.0, 3.0], [7.0, 8.0]])
    add("ties, keep 0.5", ties, "ties keep the lower index first (a stable sort)", keep=0.5)
    add("ties, keep 0.5, largest=False", ties, "ties keep the lower index first (a stable sort)", keep=0.5,
        largest=False)
    add("mean and std disagree", torch.tensor([[9.0, 9.0, 9.0], [0.0, 1.0, 2.0], [5.0, 5.0, 6.0],
                                               [0.0, 0.0, 0.0]]), rank, keep=0.5)
    add("all rewards equal", torch.zeros(4, 3), "zero std everywhere: the stats say so (group_stats)")
    add("integer rewards", torch.tensor([[0, 1], [1, 1], [3, 0], [2, 2]]), "convert to float before the std",
        keep=0.5)
    return dict(cases=cases)


def check_select(case: dict):
    got = variance_filter.select_groups(case["rewards"].clone(), **case["kw"])
    at = f"select_groups ({case['name']})"
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[1], dict)):
        return f"{at}: return (keep_mask, group_stats(...)), got a {type(got).__name__}"
    mask, stats = got
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or mask.shape != case["mask"].shape:
        return f"{at}: keep_mask must be a bool tensor of shape [G] = {list(case['mask'].shape)}"
    if not torch.equal(mask, case["mask"]):
        kept = torch.nonzero(mask).flatten().tolist()
        want = torch.nonzero(case["mask"]).flatten().tolist()
        return f"{at}: kept groups {kept}, expected {want}; {case['hint']}"
    for k, want in case["stats"].items():
        have = stats.get(k, "missing")
        if not (have == want or close(have, want)):
            return (f"{at}: the stats' {k} is {num(have)}, expected {num(want)}: return group_stats(std, "
                    f"keep_mask, std) with the unbiased std of each group")
    return None


def check_select_rejects():
    bad = [("keep 0", torch.randn(4, 3), dict(keep=0.0)), ("keep 1.5", torch.randn(4, 3), dict(keep=1.5)),
           ("one rollout per group", torch.randn(4, 1), {}), ("a 1-D tensor", torch.randn(4), {})]
    for what, rewards, kw in bad:
        try:
            variance_filter.select_groups(rewards, **kw)
        except ValueError:
            continue
        return f"select_groups accepted {what}: raise ValueError (check_groups, and keep in (0, 1])"
    return None


def grade_unit5(snap: dict, rep: Report) -> None:
    for case in snap["cases"]:
        rep.check("select_groups", lambda case=case: check_select(case), case=case["name"])
    rep.check("select_groups", check_select_rejects, case="bad inputs")


# ---- unit 6: monitor.py (echo_check)

STD, SUCCESS, GRAD, ENT, MI = ("rollout/in_group_std", "rollout/success", "train/grad_norm", "train/entropy",
                               "collapse/mi")
SIGNAL_HINTS = {
    "std_collapse": "std_collapse: once more than baseline_iters stds are known, the mean of the last "
                    "`smooth` against std_ratio x the mean of the first baseline_iters; low_std_run counts "
                    "the iterations in a row below it while the mean of the last `smooth` successes is not "
                    "above the mean of the first baseline_iters (else it is 0 again); the warning once it "
                    "reaches patience",
    "grad_spike": "grad_spike: a finite grad norm above grad_factor x the median of the last `window` norms "
                  "before it (at least 5 of them); it joins the history after the test",
    "entropy_swing": "entropy_swing: a finite entropy joins its history first; once more than baseline_iters "
                     "are known, the mean of the last `smooth` outside ent_band x the mean of the first "
                     "baseline_iters",
    "mi_collapse": "collapse/mi, where present and finite: mi_check(mon, mi) (extras/collapse.py, given) "
                   "returns the warning or None",
}
STATE_HINTS = {
    "std_history": "every iteration with a reward std appends it", "success_history": "every iteration with "
    "a reward std appends rollout/success with it (0.0 where it is missing)",
    "grad_history": "every finite grad norm, after the spike test", "ent_history": "every finite entropy, "
    "before the swing test", "low_std_run": "the low-std iterations in a row (see std_collapse)",
    "mi_history": "mi_check keeps it", "low_mi_run": "mi_check keeps it"}


def quiet(**changes) -> dict:
    """One iteration of a healthy run's four signals, with `changes` (std, success, grad, ent, mi)."""
    m = {STD: 1.0, SUCCESS: 0.5, GRAD: 1.0, ENT: 2.0}
    m.update({{"std": STD, "success": SUCCESS, "grad": GRAD, "ent": ENT, "mi": MI}[k]: v
              for k, v in changes.items()})
    return {k: v for k, v in m.items() if v is not None}


def noisy_run(rng, n: int, collapse_at: int, missing: float = 0.0) -> list[dict]:
    """A run that drifts into a collapse at `collapse_at`: the std fades, the grad norm spikes now and then,
    the entropy swings; with `missing`, each signal is absent with that probability."""
    steps = []
    for i in range(n):
        late = i >= collapse_at
        m = {STD: float(rng.uniform(0.15, 0.3) * (0.05 if late else 1.0)),
             SUCCESS: float(rng.uniform(0.4, 0.6) * (0.3 if late else 1.0)),
             GRAD: float(rng.lognormal(0.0, 0.4) * (12.0 if rng.random() < 0.08 else 1.0)),
             ENT: float(rng.uniform(0.1, 0.3) * (8.0 if late and i % 7 < 4 else 1.0))}
        steps.append({k: v for k, v in m.items() if rng.random() >= missing})
    return steps


def record_unit6() -> dict:
    rng = np.random.default_rng(6)
    cases = []

    def add(name, steps, **kw):
        mon, fired = monitor.EchoMonitor(), []
        for m in steps:
            fired.append(sorted(monitor.echo_check(mon, dict(m), **kw)))
        cases.append(dict(name=name, steps=steps, kw=kw, fired=fired, state=dataclasses.asdict(mon)))
    add("the std collapses, success flat", [quiet()] * 6 + [quiet(std=0.01)] * 6)
    add("the std vanishes while success rises (convergence)",
        [quiet(std=1.0 if i < 5 else 0.01, success=0.5 if i < 5 else 0.99, grad=1.0 + 0.5 * (i % 3),
               ent=0.3 if i % 2 else 0.08) for i in range(30)])
    add("the std falls, recovers, falls again", [quiet()] * 6 + [quiet(std=0.0)] * 5 + [quiet(std=5.0)] * 3 +
        [quiet(std=0.0)] * 8)
    add("a grad norm spike", [quiet()] * 6 + [quiet(grad=50.0)] + [quiet()] * 3)
    add("a spike before 5 norms are known", [quiet()] * 3 + [quiet(grad=50.0)] + [quiet()] * 2)
    add("an outlier in the history (the median)", [quiet(grad=g) for g in (1, 1, 1, 1, 30, 1, 1, 8, 1)])
    add("non-finite grad norms", [quiet()] * 6 + [quiet(grad=float("nan")), quiet(grad=float("inf")),
                                                  quiet(grad=8.0), quiet()])
    add("a window of the last 20 norms", [quiet(grad=10.0)] * 20 + [quiet(grad=1.0)] * 20 + [quiet(grad=8.0)])
    add("entropy: one noisy value, then a sustained rise", [quiet()] * 6 + [quiet(ent=12.0)] +
        [quiet(ent=40.0)] * 3)
    add("entropy collapses", [quiet()] * 6 + [quiet(ent=0.01)] * 6)
    add("non-finite entropies", [quiet()] * 6 + [quiet(ent=float("nan")), quiet(ent=float("inf"))] * 2 +
        [quiet()])
    add("signals missing", [{}, quiet(success=None), {GRAD: 2.0}, {ENT: 1.0}] + noisy_run(rng, 36, 18, 0.3))
    mi = [quiet(mi=v) for v in (0.8, 1.0, 1.2)] + [quiet()] * 4 + [quiet(mi=v) for v in (0.6, 0.4, 0.3, 0.9)]
    add("the template-collapse MI", mi)
    add("other thresholds", noisy_run(rng, 40, 15), baseline_iters=3, smooth=2, std_ratio=0.5, patience=2,
        grad_factor=3.0, ent_band=(0.5, 2.0), window=6)
    add("a noisy run of 60 iterations", noisy_run(rng, 60, 30))
    runs = json.loads((ROOT / "tests" / "data" / "echo_signals.json").read_text())
    keys = {"in_group_std": STD, "success": SUCCESS, "grad_norm": GRAD, "entropy": ENT}
    for name, sig in runs.items():  # docs/results.md, "The Echo Trap monitor"; tests/test_monitor.py
        add(f"the recorded run {name!r}", [{keys[k]: sig[k][i] for k in keys if sig[k][i] is not None}
                                           for i in range(len(sig["success"]))])
    return dict(cases=cases)


def same_state(got, want) -> bool:
    if isinstance(want, list):
        return isinstance(got, list) and len(got) == len(want) and \
            all(same_state(a, b) for a, b in zip(got, want))
    return got == want or close(got, want)


def check_monitor(case: dict):
    kw = dict(case["kw"], **({"ent_band": tuple(case["kw"]["ent_band"])} if "ent_band" in case["kw"] else {}))
    mon = monitor.EchoMonitor()
    at = f"echo_check ({case['name']}{', ' + str(kw) if kw else ''})"
    for i, (m, want) in enumerate(zip(case["steps"], case["fired"]), 1):
        got = monitor.echo_check(mon, dict(m), **kw)
        if not (isinstance(got, dict) and all(isinstance(k, str) and isinstance(v, str) and v
                                              for k, v in got.items())):
            return f"{at}, iteration {i}: return a dict {{signal: the warning's text}}, got {got!r}"
        if sorted(got) != want:
            extra, miss = sorted(set(got) - set(want)), sorted(set(want) - set(got))
            key = (miss or extra)[0]
            did = f"did not fire {key}" if miss else f"fired {key}"
            return (f"{at}: at iteration {i} your monitor {did} (yours: {', '.join(sorted(got)) or 'none'}; "
                    f"expected: {', '.join(want) or 'none'}; this iteration's metrics {fmt_metrics(m)}); "
                    f"{SIGNAL_HINTS[key]}" + shown(std_history=mon.std_history, grad_history=mon.grad_history,
                                                   ent_history=mon.ent_history))
    state = dataclasses.asdict(mon) if dataclasses.is_dataclass(mon) else {}
    for field, want in case["state"].items():
        got = state.get(field, "missing")
        if not same_state(got, want):
            shown_got = fmt(got[-6:]) + f" ({len(got)} values)" if isinstance(got, list) else fmt(got)
            shown_want = fmt(want[-6:]) + f" ({len(want)} values)" if isinstance(want, list) else fmt(want)
            return (f"{at}: after its {len(case['steps'])} iterations the monitor's {field} ends "
                    f"{shown_got}, expected {shown_want}: {STATE_HINTS.get(field, '')} (train.py checkpoints "
                    f"the monitor: a resumed run must warn as the uninterrupted one would)")
    return None


def fmt_metrics(m: dict) -> str:
    return "{" + ", ".join(f"{k.split('/')[1]} {num(v)}" for k, v in m.items()) + "}" if m else "{} (none)"


def grade_unit6(snap: dict, rep: Report) -> None:
    for case in snap["cases"]:
        rep.check("echo_check", lambda case=case: check_monitor(case), case=case["name"])


# ---- running

RECORD = {1: record_unit1, 2: record_unit2, 3: record_unit3, 4: record_unit4, 5: record_unit5,
          6: record_unit6}
GRADE = {1: grade_unit1, 2: grade_unit2, 3: grade_unit3, 4: grade_unit4, 5: grade_unit5, 6: grade_unit6}


def grade_unit(n: int) -> dict:
    """Run unit n's checks -> {unit, name, status, passed, total, missing, failures, skipped, points,
    max_points, line}."""
    unit = BY_NUMBER[n]
    if unit.get("lab"):
        return grade_lab(unit)
    rep = Report(unit)
    torch.manual_seed(0)
    rep.static()
    GRADE[n](load_snapshot(unit), rep)
    return rep.result()


def grade_lab(unit: dict) -> dict:
    """A lab is run by hand and its answers read (course/lab-answers.md); its line says whether the units it
    trains with pass."""
    failing = [m for m in unit["needs"] if grade_unit(m)["status"] != "pass"]
    ok = not failing
    units = f"{unit['needs'][0]}-{unit['needs'][-1]}"
    words = (f"ready -- units {units} pass: run it ({handout(unit)}); its {unit['points']} points come from "
             f"your answers (course/lab-answers.md)" if ok else
             f"not ready -- it trains with your code: first make unit{'s' * (len(failing) > 1)} "
             f"{', '.join(map(str, failing))} pass")
    return {"unit": unit["n"], "name": unit["name"], "status": "pass" if ok else "fail", "passed": int(ok),
            "total": 1, "missing": [], "failures": [] if ok else [words], "skipped": [], "points": None,
            "max_points": unit["points"], "line": f"unit {unit['n']} {unit['name']}: {words}"}


def record(numbers: list[int]) -> None:
    if STUDENT_MARK.exists():
        raise SystemExit("grade.py: error: --record: this is a student copy; snapshots come from the "
                         "reference code (the instructor's checkout)")
    SNAPSHOTS.mkdir(exist_ok=True)
    for n in numbers:
        unit = BY_NUMBER[n]
        torch.manual_seed(0)
        try:
            snap = RECORD[n]()
        except NotImplementedError as e:
            raise SystemExit(f"grade.py: error: --record needs the reference code, and {e}") from None
        text = json.dumps(enc(snap), separators=(",", ":"))
        snapshot_path(unit).write_text(text + "\n")
        print(f"recorded {snapshot_path(unit).relative_to(ROOT)} ({len(text) // 1024} KiB)")


def main(argv=None) -> int:
    global VERBOSE
    parser = Parser(prog="grade.py", description=__doc__.split("\n")[0])  # errors: one line, exit 2
    parser.add_argument("units", nargs="*", type=int, metavar="UNIT",
                        help=f"units to grade (default: {GRADED[0]}-{GRADED[-1]})")
    parser.add_argument("--json", metavar="FILE", help="also write the results to FILE (a new file)")
    parser.add_argument("--verbose", action="store_true", help="a failure shows the inputs of its case")
    parser.add_argument("--record", action="store_true", help="rewrite the snapshots from the reference code")
    args = parser.parse_args(argv)
    unknown = [n for n in args.units if n not in BY_NUMBER]
    if unknown:
        parser.error(f"no unit {unknown[0]}; the units are {', '.join(str(u['n']) for u in UNITS)}")
    numbers = args.units or GRADED
    if args.record:
        record([n for n in numbers if n in RECORD])
        return 0
    if args.json and Path(args.json).exists():
        parser.error(f"--json {args.json}: exists; nothing is replaced: choose another file or remove it")
    torch.set_num_threads(1)
    VERBOSE = args.verbose
    t0, results = time.time(), []
    for n in numbers:
        results.append(grade_unit(n))
        print(results[-1]["line"], flush=True)
    passed = sum(r["status"] == "pass" for r in results)
    scored = [r for r in results if r["points"] is not None]  # a lab's points come from its answers
    points, most = sum(r["points"] for r in scored), sum(r["max_points"] for r in scored)
    score = f", {points:g}/{most} points" if scored else ""  # a lab's come from its answers
    print(f"total: {passed}/{len(results)} units pass{score} ({time.time() - t0:.0f} s)")
    if args.json:
        summary = {"units": results, "passed": passed, "graded": len(results), "points": round(points, 1),
                   "max_points": most}
        Path(args.json).write_text(json.dumps(summary, indent=1) + "\n")
    return 0 if passed == len(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
