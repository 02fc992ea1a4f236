"""The command line of every command: :class:`CliParser`, whose usage errors are one line, :func:`run_cli`, which
turns a :class:`~timm_rollout.errors.UserError` into one line ``error: ...`` and exit code 2, and strict argument
types that reject bad values while parsing, before any data or model is loaded.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import math
import os
import re
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import UserError, fail, install_error


def run_cli(main: Callable[[list[str] | None], object], argv: list[str] | None = None) -> None:
    """Run ``main(argv)``; a :class:`UserError`, a broken torch/torchvision pair (:func:`install_error`) or the file
    system refusing a path prints one line and exits 2."""
    try:
        main(argv)
    except UserError as e:
        fail(str(e))
    except (ImportError, RuntimeError, AttributeError, OSError) as e:
        found = install_error(e)
        if found is not None:
            fail(str(found))
        if not isinstance(e, OSError):
            raise
        where = f"{e.filename}: " if e.filename else ""
        fail(f"{where}{e.strerror or e}; pass a path this machine can read and write (or free disk space) and re-run")
    except KeyboardInterrupt:
        print("interrupted; finished work is kept on disk", file=sys.stderr)
        raise SystemExit(130) from None


class HelpWithDefaults(argparse.HelpFormatter):
    """Help that ends every flag's text with its default, unless the text already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if any(action.default is unset for unset in (None, False, argparse.SUPPRESS)) \
                or action.default in ([], {}, "") or "default" in text or not action.option_strings:
            return text
        shown = " ".join(map(str, action.default)) if isinstance(action.default, list | tuple) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


class CliParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose usage errors are :class:`UserError`\\ s (one line under :func:`run_cli`) and
    whose ``--help`` gives every flag's default (:class:`HelpWithDefaults`).

    ``checks`` run on the parsed namespace (mistakes that involve several flags); ``given`` holds the destinations
    of the flags typed in the last parse; ``removed`` maps removed flags to what to use instead, ``foreign`` the
    flags of timm's ``train.py`` this command lacks to its own (both refused even where argparse would take them
    for the abbreviation of a flag: timm's ``--drop`` is no ``--drop-path``).
    """

    def __init__(self, *args: Any, checks: Sequence[Callable[[argparse.Namespace], None]] = (),
                 removed: dict[str, str] | None = None, foreign: dict[str, str] | None = None, **kwargs: Any):
        super().__init__(*args, **{"formatter_class": HelpWithDefaults, **kwargs})
        # argparse reads -1e-3 or -.5e-1 as a flag: read them as numbers, for the validators to judge
        self._negative_number_matcher = re.compile(r"^-(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?$")
        self.checks = list(checks)
        self.removed, self.foreign = dict(removed or {}), dict(foreign or {})
        self.given: frozenset[str] = frozenset()

    def error(self, message: str) -> None:  # type: ignore[override]
        head, _, rest = message.partition(": ")
        if head.startswith("argument "):
            flag = head.removeprefix("argument ").split("/")[0]  # its first name: --batch-size, not --batch-size/-b
            message = rest if rest.startswith(flag + " ") else f"argument {flag}: {rest}"  # the validator names it
            if rest in ("expected one argument", "expected at least one argument"):
                message += f"; give it after the flag, or as {flag}='...' when it starts with '-'"
        raise UserError(message)

    def parse_known_args(self, args=None, namespace=None):
        return self._parse(args, namespace, strict=False)

    def _parse(self, args, namespace, strict: bool):
        """Parse; removed flags, and unknown ones when ``strict``, are refused first, before a missing required one."""
        args = sys.argv[1:] if args is None else list(args)
        typed = [a.split("=", 1)[0] for a in args if a.startswith("-")]
        if gone := next((flag for flag in typed if flag in self.removed), None):
            raise UserError(f"{gone} was removed; {self.removed[gone]}")
        if gone := next((flag for flag in typed if flag in self.foreign), None):
            raise UserError(f"{self.foreign[gone].format(flag=gone)} ({gone} is a flag of timm's train.py)")
        unset = object()
        probe = argparse.Namespace(**{a.dest: unset for a in self._actions if a.dest != argparse.SUPPRESS})
        required = [a for a in [*self._actions, *self._mutually_exclusive_groups] if a.required]
        for item in required:
            item.required = False
        try:
            _, extras = super().parse_known_args(args, probe)  # defaults are only filled in for attributes not set yet
        finally:
            for item in required:
                item.required = True
        if strict and extras:
            self._unrecognized(extras)
        self.given = frozenset(k for k, v in vars(probe).items() if v is not unset)
        return super().parse_known_args(args, namespace)

    def parse_typed(self, args: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
        """Parse ``args`` only for which flags they type (values as typed: no types, choices, required flags or
        checks), for a command that passes them on; returns the namespace and the arguments not known here."""
        saved = [(a, a.required, a.type, a.choices) for a in self._actions]
        for action in self._actions:
            action.required, action.choices = False, None
            action.type = key_value if action.type is key_value else None
        try:
            return self.parse_known_args(args)
        finally:
            for action, required, kind, choices in saved:
                action.required, action.type, action.choices = required, kind, choices

    def typed_values(self, options: dict[str, Any]) -> dict[str, Any]:
        """``options`` (flags' destinations -> Python values, as a library call takes them; None: the default)
        through each flag's type and choices, refused as on the command line."""
        typed = {}
        for action in (a for a in self._actions if options.get(a.dest) is not None):
            value, flag, many = options[action.dest], action.option_strings[0], action.nargs == "+"
            if (action.nargs == 0 and not isinstance(value, bool)) or many != isinstance(value, (list, tuple)):
                wanted = "True or False" if action.nargs == 0 else "a list" if many else "one value"
                self.error(f"argument {flag}: takes {wanted}, got {value!r}")
            try:
                typed[action.dest] = value if action.nargs == 0 else self._get_values(
                    action, [str(v) for v in (value if many else [value])])
            except argparse.ArgumentError as e:
                self.error(str(e))
        return typed

    def parse_args(self, args=None, namespace=None):
        parsed, _ = self._parse(args, namespace, strict=True)
        for check in self.checks:
            check(parsed)
        return parsed

    def _unrecognized(self, extras: list[str]) -> None:
        options = [s for a in self._actions for s in a.option_strings]
        flag = extras[0].split("=", 1)[0]
        bare = {o.lstrip("-"): o for o in options}  # compared without the dashes every flag shares: epoch-count and
        # epocs find epochs (ratio 0.59, 0.91), capture does not find temperature (0.56)
        close = [bare[m] for m in difflib.get_close_matches(flag.lstrip("-"), bare, n=3, cutoff=0.58)] \
            if flag.startswith("-") else []
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise UserError(f"unrecognized arguments: {' '.join(extras)}{hint} (see {self.prog} --help)")


def as_flags(options: Mapping[str, Any]) -> list[str]:
    """A command's flags for ``options`` by Python name, as one command passes typed options to another: ``None``
    and ``False`` left out, ``True`` a bare flag, any other value its text."""
    flags: list[str] = []
    for name, value in options.items():
        if value is not None and value is not False:
            flags += [f"--{name.replace('_', '-')}", *([] if value is True else [str(value)])]
    return flags


def check_needs(args: argparse.Namespace, given: Collection[str], needs: Mapping[str, tuple[str, str]]) -> None:
    """Every command's one check of flags that only mean something with another one (``needs``: dest -> (the dest
    it needs, the flag to add)): one of them typed (``given``) without the other is refused, never ignored."""
    for dest, (needed, fix) in needs.items():
        if dest in given and not getattr(args, needed):
            flag, other = (f"--{d.replace('_', '-')}" for d in (dest, needed))
            raise UserError(f"{flag} only applies with {other}; add {fix} or drop {flag}")


def as_type(check: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse ``type`` from a validator that raises :class:`UserError` (argparse keeps the message)."""

    def convert(value: str) -> Any:
        try:
            return check(value)
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    convert.__name__ = getattr(check, "__name__", "value")
    return convert


def _bound(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else f"{v:g}"  # 4294967295, not 4.29497e+09


def _interval(low: float | None, high: float | None, low_open: bool, high_open: bool) -> str:
    if high is None:
        return f"{'>' if low_open else '>='} {_bound(low)}"
    if low is None:
        return f"{'<' if high_open else '<='} {_bound(high)}"
    return f"in {'(' if low_open else '['}{_bound(low)}, {_bound(high)}{')' if high_open else ']'}"


def number(kind: type = float, low: float | None = None, high: float | None = None, *, low_open: bool = False,
           high_open: bool = False) -> Callable[[str], Any]:
    """An argparse ``type``: an ``int`` or finite ``float`` inside the given bounds."""
    noun = "an integer" if kind is int else "a number"
    allowed = _interval(low, high, low_open, high_open)

    def convert(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {noun} {allowed}, got {text!r}") from None
        bad = not math.isfinite(value) or (low is not None and (value < low or (low_open and value == low))) or \
            (high is not None and (value > high or (high_open and value == high)))
        if bad:
            raise argparse.ArgumentTypeError(f"must be {noun} {allowed}, got {text}")
        return value

    convert.__name__ = kind.__name__
    return convert


# The ranges the CLIs use: counts, sizes, rates, probabilities and seeds.
positive_int, non_negative_int = number(int, 1), number(int, 0)
positive, non_negative = number(float, 0, low_open=True), number(float, 0)
fraction = number(float, 0, 1, high_open=True)  # rates and probabilities in [0, 1)
seed_arg = number(int, 0, 2**32 - 1)


class ParseKwargs(argparse.Action):
    """``KEY=VALUE ...`` into a dict, each value a Python literal where it is one, else the string: timm's
    ``timm.utils.ParseKwargs``, here so that building a parser imports no timm."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        kwargs = {}
        for item in values:
            key, value = item.split("=", 1)
            try:
                kwargs[key] = ast.literal_eval(value)
            except (ValueError, SyntaxError):
                kwargs[key] = value
        setattr(namespace, self.dest, kwargs)


class PerChannel(argparse.Action):
    """``nargs="+"`` values for the three RGB channels, or one for all three (as timm's ``--mean``/``--std``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if len(values) not in (1, 3):
            parser.error(f"{option_string} takes 3 values (R G B) or 1 for all channels, got {len(values)}")
        setattr(namespace, self.dest, list(values) * (3 // len(values)))


def kwarg(key: str, value: Any) -> str:
    """``KEY=VALUE`` as :class:`ParseKwargs` reads it back and a shell passes it on: a pair of equal numbers (an
    ``img_size`` or ``patch_size`` [32, 32]) as one, another pair as the quoted ``'img_size=(32,48)'`` (H, W)."""
    if isinstance(value, list | tuple):
        if len(set(value)) == 1:
            return f"{key}={value[0]}"
        return f"'{key}=({','.join(map(str, value))})'"
    return f"{key}={value}"


def key_value(text: str) -> str:
    """An argparse ``type`` for ``KEY=VALUE`` items (:class:`ParseKwargs` splits them)."""
    key = text.split("=", 1)[0]
    if "=" not in text or not key.isidentifier():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE (e.g. depth=2), got {text!r}")
    return text


def existing_path(text: str) -> str:
    """An argparse ``type``: a file or folder that exists (else the nearest name beside it, if one is close)."""
    path = Path(text).expanduser()
    if not path.exists():
        try:
            names = [p.name for p in path.parent.iterdir()]
        except OSError:  # no such folder, or one we cannot list: no suggestion
            names = []
        near = difflib.get_close_matches(path.name, names, n=1, cutoff=0.8)
        hint = f" (did you mean {Path(text).parent / near[0]}?)" if near else ""
        raise argparse.ArgumentTypeError(f"{text} does not exist{hint}; check the path")
    return text


def output_dir(text: str) -> str:
    """An argparse ``type``: a folder that exists or can be created, and can be written to."""
    path = Path(text).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file; pass a folder (it is created if missing)")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{parent} is a file, so {text} cannot be created; pass another folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"cannot write into {parent}; pass a folder you can write to")
    return text
