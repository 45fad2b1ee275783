"""Hand out the course: a copy of the project in which each unit's functions are stubs to write.

    python course/make.py OUT                 # the handouts with their hints
    python course/make.py OUT --spec-only     # the harder variant: each handout's spec, no hints

OUT gets every file git knows here (tracked, or new and not ignored) and the prior's weights, never runs/,
models/ or .git, nor the instructor's answer key. Each function that course/units.py lists keeps its
signature and docstring; its body becomes one line, raise NotImplementedError("unit N (name): implement FUNC
-- see course/unitN-NAME.md"). The test files that hold a slow reference loop of a cut function (or
deliberately wrong copies, test_course.py) stay out, with the tests that import them. The entry scripts
(train.py, eval.py, sft_baseline.py) first check, with course/units.require, that the units a command needs
are written, so that a stub stops a command before it writes anything. A handout's hints sit between the lines
`<!-- hint -->` and `<!-- /hint -->`: the markers go, and with --spec-only the hints too. Last, every file
of OUT is searched for the cut bodies' statements.
"""
from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))
from units import UNITS, find_function, has_docstring, stub_message  # noqa: E402

SKIP = {".git", "runs", "models", ".benchmarks", ".pytest_cache", "__pycache__"}  # never handed out
# each holds a slow, obvious reference of a cut function: the answer key, not a check
REVEALING_TESTS = {"tests/test_envs.py", "tests/test_rollout.py", "tests/test_advantages.py",
                   "tests/test_starpo.py", "tests/test_filter.py", "tests/test_course.py"}
INSTRUCTOR_ONLY = {  # never in a student copy
    "course/answer-key.md",  # the lab questions' answers
    "course/make.py"}  # it lists the statements that SHARED allows: parts of the answers
ENTRY_SCRIPTS = ("train.py", "eval.py", "sft_baseline.py")
MAIN = 'if __name__ == "__main__":\n    cli.run(main)\n'
CHECKED_MAIN = '''if __name__ == "__main__":
    # a student copy (course/make.py): a unit this command needs that is still a stub stops it here, in one
    # line, before anything is written (a run folder left behind would block the next try)
    import importlib.util as _util
    import os as _os
    import sys as _sys
    _spec = _util.spec_from_file_location(
        "course_units", _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "course", "units.py"))
    _units = _util.module_from_spec(_spec)
    _spec.loader.exec_module(_units)
    cli.run(lambda: (_units.require(_os.path.basename(__file__), _sys.argv[1:]), main()))
'''
HINT, END_HINT = "<!-- hint -->", "<!-- /hint -->"
MIN_LEAK = 30  # statements shorter than this (`m = mask > 0`) are too common to count as a leak
SHARED = {  # file -> the statements of cut bodies it may hold: code beyond the paper that restates a part of
    # a unit; grade.py fails a unit's function that calls into it (its watch), and course/README.md says so
    "engine/rooms.py": {"offsets = [dr * width + dc for dr, dc in DIRS]"},  # the room generator's offsets
    "extras/filter_rules.py": {"keep_mask = torch.zeros(G, dtype=torch.bool, device=group_rewards.device)"},
    "extras/gspo.py": {  # GSPO: StarPO's clipped loss on one ratio per sequence (--ratio-level sequence)
        "adv = torch.where(m, advantages.float(), 0.0)",
        "old = torch.where(m, old_logp.float(), logp.detach().float())",
        "clipped = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)",
        "loss_tok = torch.maximum(unclipped, clipped)",
        "return aggregate(loss_tok, mask, agg, denom), metrics"},
}


def fail(message: str):
    print(f"make.py: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def project_files(root: Path) -> list[str]:
    """The files to hand out, relative to root: git's tracked and unignored new files, and prior/."""
    try:
        out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others",
                              "--exclude-standard"], capture_output=True, check=True)
        names = [n for n in out.stdout.decode().split("\0") if n]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file but the skipped
        names = [p.relative_to(root).as_posix() for p in root.rglob("*")]
    names += [p.relative_to(root).as_posix() for p in (root / "prior").rglob("*")]  # the weights, always
    return sorted({n for n in names if (root / n).is_file() and not (set(Path(n).parts) & SKIP)
                   and not n.endswith(".pyc")})


def left_out_tests(names: list[str]) -> set[str]:
    """REVEALING_TESTS, and every test that imports one of them (it would fail to import)."""
    out = REVEALING_TESTS & set(names)
    while True:
        more = {n for n in names if n.startswith("tests/") and n.endswith(".py") and n not in out
                and any(f"from {Path(t).stem} import" in (ROOT / n).read_text() for t in out)}
        if not more:
            return out
        out |= more


def body_span(fn: ast.FunctionDef, lines: list[str]) -> tuple[int, int]:
    """1-based first and last line of the body after the docstring, comment lines above it included."""
    if has_docstring(fn):
        return fn.body[0].end_lineno + 1, fn.end_lineno
    first = fn.body[0].lineno
    while lines[first - 2].strip().startswith("#"):  # a comment that opens the body is part of the answer
        first -= 1
    return first, fn.end_lineno


def reference_bodies(root: Path = ROOT) -> dict[str, list[str]]:
    """"file:FUNC" -> each statement of its body after the docstring (ast.get_source_segment)."""
    out = {}
    for unit in UNITS:
        if unit.get("lab"):
            continue
        src = (root / unit["file"]).read_text()
        tree = ast.parse(src)
        for func in unit["funcs"]:
            fn = find_function(tree, func)
            body = fn.body[has_docstring(fn):]
            out[f"{unit['file']}:{func}"] = [ast.get_source_segment(src, s) for s in body]
    return out


def stub_file(src: str, unit: dict) -> str:
    """`src` with each of the unit's functions cut to its signature, docstring and one raise."""
    tree, lines = ast.parse(src), src.splitlines(keepends=True)
    cuts = []
    for func in unit["funcs"]:
        fn = find_function(tree, func)
        first, last = body_span(fn, lines)
        indent = " " * fn.body[0].col_offset
        cuts.append((first, last, f'{indent}raise NotImplementedError("{stub_message(unit, func)}")\n'))
    for first, last, stub in sorted(cuts, reverse=True):  # from the bottom: earlier line numbers stay valid
        lines[first - 1:last] = [stub]
    out = "".join(lines)
    ast.parse(out)
    return out


def leaks(out: Path, bodies: dict[str, list[str]]) -> list[str]:
    """'file holds a statement of file:FUNC' for every cut statement of MIN_LEAK characters found in OUT."""
    found = []
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        try:
            text = path.read_text()
        except (UnicodeDecodeError, OSError):
            continue  # the weights
        shared = SHARED.get(path.relative_to(out).as_posix(), set())
        for where, stmts in bodies.items():
            if any(len(s) >= MIN_LEAK and s not in shared and s in text for s in stmts):
                found.append(f"{path.relative_to(out)} holds a statement of {where}")
    return found


def checked_main(src: str, name: str) -> str:
    """An entry script whose `__main__` first calls course/units.require (CHECKED_MAIN)."""
    if src.count(MAIN) != 1:
        fail(f"{name}: expected its last lines to be `{MAIN.strip()}` once (make.py rewrites them to check "
             f"the units a command needs first); nothing handed out")
    out = src.replace(MAIN, CHECKED_MAIN)
    ast.parse(out)
    return out


def handout_text(text: str, spec_only: bool) -> str:
    """A handout without its hint markers; with spec_only, without the hints between them either."""
    out, hint = [], False
    for line in text.splitlines(keepends=True):
        if line.strip() == HINT:
            hint = True
        elif line.strip() == END_HINT:
            hint = False
        elif not (hint and spec_only):
            out.append(line)
    if hint:
        raise ValueError(f"a {HINT} without its {END_HINT}")
    text = "".join(out)
    while spec_only and "\n\n\n" in text:  # a hint between two blank lines leaves one blank line
        text = text.replace("\n\n\n", "\n\n")
    return text.rstrip("\n") + "\n" if spec_only else text


def make(out: Path, spec_only: bool = False) -> tuple[int, list[str]]:
    """Write the student copy into `out` -> (files written, tests left out)."""
    names = project_files(ROOT)
    dropped = left_out_tests(names)
    names = [n for n in names if n not in dropped and n not in INSTRUCTOR_ONLY]
    for n in names:
        (out / n).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / n, out / n)
    for unit in UNITS:
        if not unit.get("lab"):
            (out / unit["file"]).write_text(stub_file((ROOT / unit["file"]).read_text(), unit))
    for script in ENTRY_SCRIPTS:
        (out / script).write_text(checked_main((ROOT / script).read_text(), script))
    for path in sorted((out / "course").glob("unit*.md")):
        try:
            path.write_text(handout_text(path.read_text(), spec_only))
        except ValueError as e:
            fail(f"course/{path.name}: {e}; nothing handed out")
    # grade.py --record refuses here: a student's outputs must never become the snapshots
    kind = "the spec-only variant (--spec-only)" if spec_only else "the handouts with hints"
    (out / "course" / "STUDENT_COPY").write_text(f"a student copy, made by course/make.py: {kind}\n")
    found = leaks(out, reference_bodies())
    if found:
        for p in out.iterdir():  # OUT was empty: all of it is ours
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        fail(f"{found[0]} (and {len(found) - 1} more): nothing handed out")
    return len(names), sorted(dropped)


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    spec_only = "--spec-only" in args
    args = [a for a in args if a != "--spec-only"]
    if len(args) != 1 or args[0].startswith("-"):
        fail("usage: python course/make.py OUT [--spec-only] (OUT: a new or empty folder)")
    out = Path(args[0]).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"{args[0]} exists and is not an empty folder; nothing written: choose a new folder")
    if out == ROOT or ROOT in out.parents:
        fail(f"{args[0]} lies inside the project; the next copy would copy it: choose a folder outside")
    out.mkdir(parents=True, exist_ok=True)
    n, dropped = make(out, spec_only)
    cut = sum(len(u["funcs"]) for u in UNITS if not u.get("lab"))
    print(f"wrote {out}: {n} files, {cut} functions cut to stubs{', spec-only handouts' * spec_only}; left "
          f"out (they hold the answers): {', '.join(dropped + sorted(INSTRUCTOR_ONLY))}")
    print(f"a student starts with: cd {out} && python course/grade.py")


if __name__ == "__main__":
    main()
