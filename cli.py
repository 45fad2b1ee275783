"""Command-line flags from a `@dataclass Config`, and the rules every entry script follows with bad input.

Shared by train.py, eval.py, sft_baseline.py, webshop.py and bench.py so that all of them read the same way: a
plain dataclass is the whole configuration; this file turns it into kebab-case argparse flags and back, and
turns every bad input into one line on stderr and exit code 2 (`train.py: error: --lr -1.0: must be > 0`),
never a traceback: argparse's own errors (one line, no usage block), non-finite numbers (rejected while
parsing), files that are missing, unreadable or corrupt (named, with what is wrong), output paths that cannot
be written, run folders that would be overwritten. Ctrl-C ends a script with one line and exit code 130.

Deviations from the paper / RAGEN: none (RAGEN configures runs with Hydra YAML; we use flags).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import typing
from pathlib import Path

SEED_MAX = 2 ** 31 - 1  # seeds are mixed into 64-bit generator seeds (seed * 1_000_003 + iteration + rank << 40)


def flag(default, help: str, choices=None, lo=None, hi=None, gt=None, lt=None):
    """A Config field with its help string and allowed values: `choices` (a dict such as envs.ENVS is read when the
    flag is parsed, so an env registered after import is allowed too), or bounds lo <= x <= hi, gt < x < lt,
    checked by `bounds` once the per-model defaults are filled in."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "bounds": (lo, gt, hi, lt)})


def bounds(cfg) -> list[tuple[bool, str]]:
    """The (ok, message) rules of every field's bounds (`flag`), for `check`; a value still None is not checked."""
    rules = []
    for f in dataclasses.fields(cfg):
        lo, gt, hi, lt = f.metadata.get("bounds", (None,) * 4)
        v = getattr(cfg, f.name)
        if v is None or (lo, gt, hi, lt) == (None,) * 4:
            continue
        ok = (lo is None or v >= lo) and (gt is None or v > gt) and (hi is None or v <= hi) and (lt is None or v < lt)
        low, high = lo if lo is not None else gt, hi if hi is not None else lt
        if low is None or high is None:
            allowed = next(f"{op} {b:g}" for op, b in ((">=", lo), (">", gt), ("<=", hi), ("<", lt)) if b is not None)
        elif isinstance(v, int) and lo is not None and hi is not None:
            allowed = f"in {lo}..{hi}"
        else:
            allowed = f"in {'[' if lo is not None else '('}{low:g}, {high:g}{']' if hi is not None else ')'}"
        rules.append((ok, f"--{f.name.replace('_', '-')} {v}: must be {allowed}"))
    return rules


def finite_float(text: str) -> float:
    """argparse type: a float that is a number (nan, inf and -inf are refused while parsing)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


class Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (`prog: error: argument --steps: invalid int value: 'x'`), without the
    usage block, so that every bad input of every script reads the same way."""

    def error(self, message):
        fail(message, self.prog)


def _parse_type(tp):
    """The scalar type of an annotation such as `int`, `float | None`, `list[str]`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is list:
        return args[0], "+"
    if args:
        return _parse_type(args[0])
    return tp, None


def build_parser(cls, description: str, prog: str | None = None) -> argparse.ArgumentParser:
    parser = Parser(prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("derived"):  # computed after parsing, not a flag
            continue
        name = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        tp, nargs = _parse_type(hints[f.name])
        # default=SUPPRESS: only flags the user typed land in the namespace (presets must not override them)
        if "(default:" not in help_:  # per-model defaults (None here) say their values in the help itself
            help_ = f"{help_} (default: {f.default})"
        if tp is bool:
            parser.add_argument(name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=help_)
        else:
            parser.add_argument(name, type=finite_float if tp is float else tp, nargs=nargs,
                                choices=f.metadata.get("choices"), default=argparse.SUPPRESS,
                                metavar=f.name.upper(), help=help_)
    return parser


def parse(cls, argv=None, description: str = "", presets: dict | None = None, preset_field: str = "preset",
          prog: str | None = None):
    """-> (cfg, explicit): the Config with preset values applied under the flags that were typed. `prog`: the
    name flag errors start with (default: the script's)."""
    parser = build_parser(cls, description, prog)
    given = vars(parser.parse_args(argv))
    values = {}
    if presets is not None and given.get(preset_field):
        values.update(presets[given[preset_field]])
    values.update(given)
    return cls(**values), set(given)


def fill_defaults(cfg, defaults: dict) -> None:
    """Set every field of `cfg` that is still None to its value in `defaults` (the per-model defaults)."""
    for k, v in defaults.items():
        if getattr(cfg, k) is None:
            setattr(cfg, k, v)


def check(rules: list[tuple[bool, str]]) -> None:
    """Raise ValueError with the message of the first (ok, message) rule that does not hold."""
    for ok, message in rules:
        if not ok:
            raise ValueError(message)


def read_json(path: Path | str, what: str) -> dict:
    """A JSON object from a file the user pointed at; ValueError naming the file and what is wrong with it."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"{what}: {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: cannot read {path} ({e})") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{what}: {path} is not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what}: {path} holds a JSON {type(data).__name__}, not an object")
    return data


def writable_file(path: str, flag_name: str, new: bool = False) -> Path:
    """Check, before any work, that `path` can be written (its folder exists, it is not a folder itself; `new`:
    it does not exist yet, so no earlier result is replaced)."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ValueError(f"{flag_name} {path}: is a folder, not a file")
    if new and p.exists():
        raise ValueError(f"{flag_name} {path}: exists; nothing is replaced: choose another file or remove it first")
    if not parent.is_dir():
        raise ValueError(f"{flag_name} {path}: its folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{flag_name} {path}: not writable")
    return p


# What a run writes into its folder (train.py, sft_baseline.py, --plot): --overwrite removes these and only these
RUN_FILES = ("config.json", "metrics.jsonl", "latest", ".latest.tmp", "ckpt-*", ".tmp-ckpt-*", "trajectories-*.txt",
             "final", "echo_trap.png", "result.json", "expert-trajectories.txt")


def foreign_files(folder: Path, patterns=RUN_FILES) -> list[str]:
    """The entries of `folder` that none of `patterns` (what the script writes) matches."""
    return sorted(p.name for p in folder.iterdir() if not any(p.match(pat) for pat in patterns))


def run_folder(path: str, flag_name: str, overwrite: bool, resumable: bool = False, patterns=RUN_FILES,
               marker: tuple[str, ...] = ("config.json", "metrics.jsonl"), what: str = "a run") -> Path:
    """Check that a new run may be written into `path` and nothing there would be lost: a folder that does not
    exist yet (its parent must be a writable folder, or creatable), an empty one, or, with --overwrite, an
    earlier run's folder: one that holds the `marker` files and nothing that `patterns` (what a run writes) does
    not match. A model folder, the shipped prior or any other folder is refused whatever the flags
    (`resumable`: the script has --resume, and the error says so). Nothing is written here."""
    if not path:
        raise ValueError(f"{flag_name} '': needs a folder path")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag_name} {path}: exists and is not a folder")
    if p.is_dir() and any(p.iterdir()):
        foreign = foreign_files(p, patterns)
        if foreign or not all((p / m).exists() for m in marker):
            names = foreign or sorted(x.name for x in p.iterdir())
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise ValueError(f"{flag_name} {path}: holds files that {what} does not write ({shown}); nothing there "
                             f"is replaced, even with --overwrite: choose another {flag_name}")
        if not overwrite:
            resume = f"continue it with --resume {path}, " if resumable else f"choose another {flag_name}, "
            raise ValueError(f"{flag_name} {path}: {what} is already there; {resume}or replace it with --overwrite")
    existing = next(q for q in [p, *p.parents] if q.exists())  # the nearest folder that exists
    if not existing.is_dir():
        raise ValueError(f"{flag_name} {path}: {existing} is a file, so no folder can be made under it")
    if not os.access(existing, os.W_OK):
        raise ValueError(f"{flag_name} {path}: {existing} is not writable")
    return p


def clear_run_folder(folder: Path, patterns=RUN_FILES) -> None:
    """--overwrite, once the inputs are checked: remove what an earlier run wrote (run_folder allowed only
    a folder that holds nothing else), never the folder's other contents."""
    import shutil
    if folder.is_dir():
        for p in folder.iterdir():
            if any(p.match(pat) for pat in patterns):
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def fail(message: str, prog: str | None = None, code: int = 2) -> typing.NoReturn:
    """Print one error line and exit (argparse's usage-error code 2 by default)."""
    prog = prog or Path(sys.argv[0]).name
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(code)


def run(main) -> None:
    """An entry script's `__main__`: main(); Ctrl-C ends it with one line (what main put in the KeyboardInterrupt,
    e.g. how to resume) and exit code 130, the shell's code for SIGINT."""
    try:
        main()
    except KeyboardInterrupt as e:
        detail = f" {e}" if str(e) else ""
        print(f"{Path(sys.argv[0]).name}: interrupted{detail}", file=sys.stderr)
        raise SystemExit(130) from None
