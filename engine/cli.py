"""Command-line flags from a `@dataclass Config`, and the rules every entry script follows with bad input.

A plain dataclass is a script's whole configuration; `flag` gives a field its help and bounds, `parse` turns
the fields into kebab-case flags and back. Every bad input becomes one line on stderr and exit code 2
(`train.py: error: --lr -1.0: must be > 0`), never a traceback: argparse's errors, non-finite numbers, files
that are missing or corrupt, outputs that cannot be written, folders that would be overwritten. Ctrl-C: one
line, exit code 130. RAGEN configures runs with Hydra YAML; flags are the only difference.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
import typing
from pathlib import Path

SEED_MAX = 2 ** 31 - 1  # seeds are mixed into 64-bit generator seeds (train.seed_of)


def flag(default, help: str, choices=None, lo=None, hi=None, gt=None, lt=None, beyond: bool = False):
    """A Config field with its help string and allowed values: `choices` (a dict such as envs.ENVS is read
    when the flag is parsed, so an env registered after import is allowed too), or bounds lo <= x <= hi,
    gt < x < lt, checked by `bounds` once the per-model defaults are filled in. `beyond`: an option beyond the
    paper, whose default is the paper's method (`opt_ins` lists those a run changed)."""
    meta = {"help": help, "choices": choices, "bounds": (lo, gt, hi, lt), "beyond": beyond}
    return dataclasses.field(default=default, metadata=meta)


def option(default, help: str, **bounds):
    """A `flag` beyond the paper (`beyond=True`): its default is the paper's method."""
    return flag(default, help, beyond=True, **bounds)


def opt_ins(cfg) -> list[str]:
    """The fields marked `beyond` that differ from their default: the options beyond the paper a run uses. A
    field whose default is None takes a per-model value (an option's learning rate): it names no option."""
    return [f.name for f in dataclasses.fields(cfg)
            if f.metadata.get("beyond") and f.default is not None and getattr(cfg, f.name) != f.default]


def paper_first(cls_or_cfg) -> list:
    """The dataclass's fields, the paper's first and the options beyond it after (a Config may inherit its
    options from a base class, whose fields dataclasses lists first): the order of `--help` and `as_dict`."""
    return sorted(dataclasses.fields(cls_or_cfg), key=lambda f: bool(f.metadata.get("beyond")))


def as_dict(cfg) -> dict:
    """dataclasses.asdict in `paper_first` order (config.json, the logged config)."""
    values = dataclasses.asdict(cfg)
    return {f.name: values[f.name] for f in paper_first(cfg)}


def bounds(cfg) -> list[tuple[bool, str]]:
    """The (ok, message) rules of every field's bounds (`flag`), for `check`; a value still None is not
    checked."""
    rules = []
    for f in dataclasses.fields(cfg):
        lo, gt, hi, lt = f.metadata.get("bounds", (None,) * 4)
        v = getattr(cfg, f.name)
        if v is None or (lo, gt, hi, lt) == (None,) * 4:
            continue
        ok = (lo is None or v >= lo) and (gt is None or v > gt) and (hi is None or v <= hi) \
            and (lt is None or v < lt)
        low, high = lo if lo is not None else gt, hi if hi is not None else lt
        if low is None or high is None:
            allowed = next(f"{op} {b:g}" for op, b in ((">=", lo), (">", gt), ("<=", hi), ("<", lt))
                           if b is not None)
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
    """argparse, but an error is one line (`prog: error: argument --steps: invalid int value: 'x'`), without
    the usage block, so that every bad input of every script reads the same way; and a negative number in
    scientific notation (`--lr -1e-4`) is a value, so that it meets the value's check ("must be > 0"), where
    argparse alone took it for a flag ("expected one argument")."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$|^-(inf|nan)$", re.I)

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
    parser = Parser(prog=prog, description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    hints = typing.get_type_hints(cls)
    beyond = parser.add_argument_group("beyond the paper (opt-in; each default is the paper's method)")
    for f in paper_first(cls):  # the paper's flags first, the options beyond it after
        if f.metadata.get("derived"):  # computed after parsing, not a flag
            continue
        group = beyond if f.metadata.get("beyond") else parser
        name = "--" + f.name.replace("_", "-")
        help_ = f.metadata.get("help", "")
        tp, nargs = _parse_type(hints[f.name])
        # per-model defaults (None here) say their values in the help itself: one default per flag
        if "default:" not in help_ and f.default is not None:
            help_ = f"{help_} (default: {f.default})"
        # default=SUPPRESS: only flags the user typed land in the namespace (presets must not override them)
        if tp is bool:
            group.add_argument(name, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                               help=help_)
        else:
            group.add_argument(name, type=finite_float if tp is float else tp, nargs=nargs,
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


def default_out(cfg, explicit: set[str], base: str, named: tuple[str, ...] = ()) -> str:
    """A run's default folder: `base`, the values of the `named` fields, and a digest of every other typed
    flag that differs from its default (but --steps and the machine's), so that two commands never share
    one."""
    same = {"steps", "device", "threads", "overwrite", "resume", "out", *named}
    typed = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)
             if f.name in explicit - same and getattr(cfg, f.name) != f.default}
    digest = hashlib.sha1(json.dumps(typed, sort_keys=True).encode()).hexdigest()[:6] if typed else ""
    return "-".join(str(x) for x in (base, *(getattr(cfg, n) for n in named), digest) if x)


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
    """Check, before any work, that `path` can be written (its folder exists, it is not a folder itself;
    `new`: it does not exist yet, so no earlier result is replaced)."""
    p = Path(path)
    parent = p.parent if str(p.parent) else Path(".")
    if p.is_dir():
        raise ValueError(f"{flag_name} {path}: is a folder, not a file")
    if new and p.exists():
        raise ValueError(f"{flag_name} {path}: exists; nothing is replaced: choose another file or remove it")
    if not parent.is_dir():
        raise ValueError(f"{flag_name} {path}: its folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise ValueError(f"{flag_name} {path}: not writable")
    return p


# What a run writes into its folder (train.py, sft_baseline.py, python tools/plot.py RUNS... [--out PNG]):
# --overwrite removes these, nothing else
RUN_FILES = ("config.json", "metrics.jsonl", "latest", ".latest.tmp", "ckpt-*", ".tmp-ckpt-*",
             "trajectories-*.txt", "final", "echo_trap.png", "result.json", "expert-trajectories.txt")


def is_run(folder: Path, marker=("config.json", "metrics.jsonl"), patterns=RUN_FILES) -> bool:
    """Whether `folder` holds a run: the `marker` files, and nothing that a run does not write."""
    return (folder.is_dir() and all((folder / m).is_file() for m in marker)
            and not foreign_files(folder, patterns))


def foreign_files(folder: Path, patterns=RUN_FILES) -> list[str]:
    """The entries of `folder` that none of `patterns` (what the script writes) matches."""
    return sorted(p.name for p in folder.iterdir() if not any(p.match(pat) for pat in patterns))


def run_folder(path: str, flag_name: str, overwrite: bool, resumable: bool = False, patterns=RUN_FILES,
               marker: tuple[str, ...] = ("config.json", "metrics.jsonl"), what: str = "a run") -> Path:
    """Check that a new run may be written into `path` and nothing there would be lost: a folder that does not
    exist yet (its parent must be a writable folder, or creatable), an empty one, or, with --overwrite, an
    earlier run's folder: one that holds the `marker` files and nothing that `patterns` (what a run writes)
    does not match. A model folder, the shipped prior or any other folder is refused whatever the flags
    (`resumable`: the script has --resume, and the error says so). Nothing is written here."""
    if not path:
        raise ValueError(f"{flag_name} '': needs a folder path")
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{flag_name} {path}: exists and is not a folder")
    if p.is_dir() and any(p.iterdir()):
        if not is_run(p, marker, patterns):
            names = foreign_files(p, patterns) or sorted(x.name for x in p.iterdir())
            shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
            raise ValueError(f"{flag_name} {path}: holds files that {what} does not write ({shown}); nothing "
                             f"there is replaced, even with --overwrite: choose another {flag_name}")
        if not overwrite:
            resume = f"continue it with --resume {path}, " if resumable else f"choose another {flag_name}, "
            raise ValueError(f"{flag_name} {path}: {what} is already there; {resume}or replace it with "
                             f"--overwrite")
    existing = next(q for q in [p, *p.parents] if q.exists())  # the nearest folder that exists
    if not existing.is_dir():
        raise ValueError(f"{flag_name} {path}: {existing} is a file, so no folder can be made under it")
    if not os.access(existing, os.W_OK):
        raise ValueError(f"{flag_name} {path}: {existing} is not writable")
    return p


def clear_run_folder(folder: Path, patterns=RUN_FILES) -> None:
    """--overwrite, once the inputs are checked: remove what an earlier run wrote (`run_folder` allowed only
    a folder that holds nothing else), never anything else."""
    for p in folder.iterdir() if folder.is_dir() else []:
        if any(p.match(pat) for pat in patterns):
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()


def fail(message: str, prog: str | None = None, code: int = 2) -> typing.NoReturn:
    """Print one error line and exit (argparse's usage-error code 2 by default)."""
    prog = prog or Path(sys.argv[0]).name
    print(f"{prog}: error: {' '.join(str(message).split())}", file=sys.stderr)
    raise SystemExit(code)


@contextlib.contextmanager
def one_line_errors(prog: str | None = None):
    """Inside the block, a ValueError (a bad input, named by its flag) ends the script with one line on
    stderr and exit code 2 (`fail`); the entry scripts check and load everything inside one, before the
    run writes anything."""
    try:
        yield
    except ValueError as e:
        fail(str(e), prog)


def run(main) -> None:
    """An entry script's `__main__`: main(); Ctrl-C ends it with one line (what main put in the
    KeyboardInterrupt, e.g. how to resume) and exit code 130, the shell's code for SIGINT. In a student copy
    (course/make.py) a stub's NotImplementedError("unit N ...") is one line too, exit code 2."""
    try:
        main()
    except NotImplementedError as e:
        if not str(e).startswith("unit "):
            raise
        fail(str(e))
    except KeyboardInterrupt as e:
        detail = f" {e}" if str(e) else ""
        print(f"{Path(sys.argv[0]).name}: interrupted{detail}", file=sys.stderr)
        raise SystemExit(130) from None
