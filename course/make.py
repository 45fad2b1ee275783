"""Hand out the course: a copy of the project in which each unit's functions are stubs to write.

    python course/make.py OUT

OUT gets every file git knows here (tracked, or new and not ignored) and the prior's weights, never runs/,
models/ or .git. Each function that course/units.py lists keeps its signature and docstring; its body becomes
one line, raise NotImplementedError("unit N (name): implement FUNC -- see course/unitN-NAME.md"). The test
files that hold a slow reference loop of a cut function (or deliberately wrong copies, test_course.py) stay
out, with the tests that import them. Last, every file of OUT is searched for the cut bodies' statements.
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
from units import UNITS, stub_message  # noqa: E402

SKIP = {".git", "runs", "models", ".benchmarks", ".pytest_cache", "__pycache__"}  # never handed out
# each holds a slow, obvious reference of a cut function: the answer key, not a check
REVEALING_TESTS = {"tests/test_envs.py", "tests/test_rollout.py", "tests/test_advantages.py",
                   "tests/test_starpo.py", "tests/test_filter.py", "tests/test_course.py"}
MIN_LEAK = 30  # statements shorter than this (`m = mask > 0`) are too common to count as a leak
SHARED = {  # set-up lines that other code needs too (engine/rooms.py, extras/filter_rules.py): not answers
    "offsets = [dr * width + dc for dr, dc in DIRS]",
    "keep_mask = torch.zeros(G, dtype=torch.bool, device=group_rewards.device)"}


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
        for where, stmts in bodies.items():
            if any(len(s) >= MIN_LEAK and s not in SHARED and s in text for s in stmts):
                found.append(f"{path.relative_to(out)} holds a statement of {where}")
    return found


def make(out: Path) -> tuple[int, list[str]]:
    """Write the student copy into `out` -> (files written, tests left out)."""
    names = project_files(ROOT)
    dropped = left_out_tests(names)
    names = [n for n in names if n not in dropped]
    for n in names:
        (out / n).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / n, out / n)
    for unit in UNITS:
        if not unit.get("lab"):
            (out / unit["file"]).write_text(stub_file((ROOT / unit["file"]).read_text(), unit))
    # grade.py --record refuses here: a student's outputs must never become the snapshots
    (out / "course" / "STUDENT_COPY").write_text("a student copy, made by course/make.py\n")
    found = leaks(out, reference_bodies())
    if found:
        for p in out.iterdir():  # OUT was empty: all of it is ours
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        fail(f"{found[0]} (and {len(found) - 1} more): nothing handed out")
    return len(names), sorted(dropped)


def main(argv=None):
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1 or args[0].startswith("-"):
        fail("usage: python course/make.py OUT (a new or empty folder)")
    out = Path(args[0]).resolve()
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        fail(f"{args[0]} exists and is not an empty folder; nothing written: choose a new folder")
    if out == ROOT or ROOT in out.parents:
        fail(f"{args[0]} lies inside the project; the next copy would copy it: choose a folder outside")
    out.mkdir(parents=True, exist_ok=True)
    n, dropped = make(out)
    cut = sum(len(u["funcs"]) for u in UNITS if not u.get("lab"))
    print(f"wrote {out}: {n} files, {cut} functions cut to stubs; left out (they hold the answers): "
          f"{', '.join(dropped)}")
    print(f"a student starts with: cd {out} && python course/grade.py")


if __name__ == "__main__":
    main()
