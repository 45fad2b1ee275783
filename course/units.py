"""The course's units, in order: what course/make.py cuts from the reference code and course/grade.py checks.

Each unit names the file it lives in and the functions a student writes ("Class.method" for a method); a lab
has no functions of its own and names the units it runs on. The handout of unit N is course/unitN-NAME.md.
`points`: what the unit is worth (a unit's points are shared equally among its checks; a lab's among its
questions, course/lab-answers.md). `hours`: our estimate of a student's time, reading and runs included (not
measured on a class). `require` is what an entry script of a student copy calls first (make.py writes the
call), so that a command stops at a stub it needs before it writes anything.
"""
from __future__ import annotations

import ast
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

UNITS = [
    dict(n=1, name="envs", file="envs.py", funcs=["_push", "sokoban_bfs", "SokobanEnv._apply"], points=15,
         hours="2-3", title="an environment's step and its BFS expert (section 3.1)"),
    dict(n=2, name="rollout", file="rollout.py", funcs=["parse_reply", "trained_mask", "Segment.append"],
         points=15, hours="2-3",
         title="the reply parser and the loss mask from recorded positions (section 2.1, Figure 2)"),
    dict(n=3, name="advantages", file="advantages.py", funcs=["grpo_advantages", "gae"], points=15, hours="2",
         title="GRPO's group normalisation, Dr.GRPO's switch, and GAE (section 2.2, Appendix A)"),
    dict(n=4, name="loss", file="starpo.py", funcs=["aggregate", "policy_loss", "kl_penalty"], points=15,
         hours="2-3",
         title="the token-level clipped loss, Clip-Higher, the KL term, the aggregation (sections 2.2, 4.2)"),
    dict(n=5, name="filter", file="filter.py", funcs=["select_groups"], points=5, hours="1",
         title="StarPO-S's variance filter (section 4.2)"),
    dict(n=6, name="monitor", file="monitor.py", funcs=["echo_check"], points=10, hours="1-2",
         title="the Echo Trap monitor: the collapse's early-warning signals (section 4.1)"),
    dict(n=7, name="echo-trap", lab=True, needs=[2, 3, 4, 5, 6], points=25, hours="3-4",
         title="lab: the Echo Trap with your own code (sections 4.1-4.2)"),
    dict(n=8, name="sft", lab=True, needs=[1, 2, 3, 4, 5, 6], points=10, optional=True, hours="3-4",
         title="lab, optional (bonus points): expert SFT against RL (Appendix G)"),
]
BY_NUMBER = {u["n"]: u for u in UNITS}
GRADED = [u["n"] for u in UNITS if not u.get("lab")]  # what `python course/grade.py` grades by default

# The units each entry script runs on. Sokoban's step and expert (unit 1) only where the command's env is
# Sokoban: Bandit and FrozenLake never call them. train.py's monitor (unit 6) runs every iteration.
SCRIPT_UNITS = {"train.py": [2, 3, 4, 5, 6], "eval.py": [2], "sft_baseline.py": [2]}
DEFAULT_ENV = "sokoban"  # the --env default of all three scripts


def handout(unit: dict) -> str:
    return f"course/unit{unit['n']}-{unit['name']}.md"


def stub_message(unit: dict, func: str) -> str:
    """What a stub raises; engine/cli.py prints a NotImplementedError that starts with "unit " as one line."""
    return f"unit {unit['n']} ({unit['name']}): implement {func} -- see {handout(unit)}"


def find_function(tree: ast.Module, qualname: str) -> ast.FunctionDef:
    body = tree.body
    *classes, name = qualname.split(".")
    for cls in classes:
        body = next(n for n in body if isinstance(n, ast.ClassDef) and n.name == cls).body
    return next(n for n in body if isinstance(n, ast.FunctionDef) and n.name == name)


def has_docstring(fn: ast.FunctionDef) -> bool:
    first = fn.body[0]
    return isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and \
        isinstance(first.value.value, str)


def is_stub(fn: ast.FunctionDef) -> bool:
    """Whether a function's body, after its docstring, is make.py's `raise NotImplementedError("unit ..")`."""
    body = fn.body[has_docstring(fn):]
    if len(body) != 1 or not isinstance(body[0], ast.Raise) or not isinstance(body[0].exc, ast.Call):
        return False
    call = body[0].exc
    return isinstance(call.func, ast.Name) and call.func.id == "NotImplementedError" and len(call.args) == 1 \
        and isinstance(call.args[0], ast.Constant) and str(call.args[0].value).startswith("unit ")


def stubs(unit: dict, root: Path = ROOT) -> list[str]:
    """The unit's functions still stubs in its file on disk (read with ast: nothing is imported or run)."""
    tree = ast.parse((root / unit["file"]).read_text())
    out = []
    for func in unit["funcs"]:
        try:
            fn = find_function(tree, func)
        except StopIteration:  # renamed or deleted: the grader says so; not a stub
            continue
        if is_stub(fn):
            out.append(func)
    return out


def flag_value(argv: list[str], name: str) -> str | None:
    """The last value typed for `--name` (`--name V` or `--name=V`), else None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


def command_envs(argv: list[str]) -> list[str]:
    """The environments a command runs on: --env or --envs, else a resumed run's own, else the default."""
    value = flag_value(argv, "--envs") or flag_value(argv, "--env")
    resume = flag_value(argv, "--resume")
    if value is None and resume is not None:
        try:  # a resumed run's env is in its config (a bad folder is the script's own error to report)
            value = json.loads((Path(resume) / "config.json").read_text()).get("env")
        except (OSError, ValueError, AttributeError):
            value = None
    return [e.strip() for e in (value or DEFAULT_ENV).split(",")]


def needed_units(script: str, argv: list[str]) -> list[int]:
    extra = [1] if any(e.startswith("sokoban") for e in command_envs(argv)) else []
    return sorted(set(SCRIPT_UNITS.get(script, [])) | set(extra))


def require(script: str, argv: list[str], root: Path = ROOT) -> None:
    """In a student copy, before `script` runs: NotImplementedError(stub_message) for the first function
    still a stub among the units this command needs (engine/cli.run prints it as one line, exit code 2).
    Checked on the source, before the script loads a model or makes its run folder; --help is never
    stopped."""
    if "-h" in argv or "--help" in argv:
        return
    for n in needed_units(script, argv):
        missing = stubs(BY_NUMBER[n], root)
        if missing:
            raise NotImplementedError(stub_message(BY_NUMBER[n], missing[0]))
