"""Command-line flags from a `@dataclass Config`: one kebab-case flag per field, its help from the field.

Shared by train.py, eval.py and sft_baseline.py so that all three read the same way (guide rule 2): a plain
dataclass is the whole configuration; this file only turns it into argparse flags and back, and reports bad
values as one line (`train.py: error: --lr -1.0: must be > 0`) instead of a traceback.

Deviations from the paper / RAGEN: none (RAGEN configures runs with Hydra YAML; we use flags).
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import typing


def flag(default, help: str, choices=None):
    """A Config field with its help string (and allowed values)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def _parse_type(tp):
    """The scalar type of an annotation such as `int`, `float | None`, `list[str]`."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) is list:
        return args[0], "+"
    if args:
        return _parse_type(args[0])
    return tp, None


def build_parser(cls, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
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
            parser.add_argument(name, type=tp, nargs=nargs, choices=f.metadata.get("choices"),
                                default=argparse.SUPPRESS, metavar=f.name.upper(), help=help_)
    return parser


def parse(cls, argv=None, description: str = "", presets: dict | None = None, preset_field: str = "preset"):
    """-> (cfg, explicit): the Config with preset values applied under the flags that were typed."""
    parser = build_parser(cls, description)
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


def fail(message: str, prog: str | None = None) -> typing.NoReturn:
    """Print one error line and exit with argparse's usage-error code."""
    prog = prog or sys.argv[0].rsplit("/", 1)[-1]
    print(f"{prog}: error: {message}", file=sys.stderr)
    raise SystemExit(2)
