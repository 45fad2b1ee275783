"""The project's layers, read from the source with `ast`: engine/ is a library under the paper's files,
extras/ plug in by name, and train.py's loop names no option.

- engine/ imports no top-level module (envs, rollout, train, ...), nothing from extras/ or tools/, not even
  lazily inside a function;
- extras/ imports no entry script (train, eval, sft_baseline), so an option cannot reach into a loop;
- train.main has no `from extras ...` import and reads no field of an option beyond the paper: options enter
  through train.extension_points.
"""
import ast
import dataclasses
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
TOP = {p.stem for p in ROOT.glob("*.py")}
ENTRY = {"train", "eval", "sft_baseline"}


def imported(path: Path) -> list[tuple[int, str]]:
    """(line, the top module's name) of every import in the file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module.split(".")[0]))
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "engine").glob("*.py")), ids=lambda p: p.name)
def test_engine_imports_nothing_above_it(path):
    bad = [f"{path.name}:{line} imports {name}" for line, name in imported(path)
           if name in TOP or name in ("extras", "tools", "course")]
    assert not bad, bad


@pytest.mark.parametrize("path", sorted((ROOT / "extras").glob("*.py")), ids=lambda p: p.name)
def test_extras_import_no_entry_script(path):
    bad = [f"{path.name}:{line} imports {name}" for line, name in imported(path) if name in ENTRY]
    assert not bad, bad


def test_train_main_names_no_option():
    import train
    tree = ast.parse((ROOT / "train.py").read_text())
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    imports = [n.module for n in ast.walk(main) if isinstance(n, ast.ImportFrom)]
    assert not [m for m in imports if m and m.startswith("extras")], imports
    options = {f.name for f in dataclasses.fields(train.Config) if f.metadata.get("beyond")}
    read = {n.attr for n in ast.walk(main) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "cfg"}
    assert not read & options, sorted(read & options)
