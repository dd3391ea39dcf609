"""Typed fields from plain data (keyword arguments, YAML, JSON): one checker and one wording of errors.

``PPOConfig`` checks its fields with it, and so does the pipeline's params loader (``stages/shared/params.py``) for its
own sections: a problem reads the same wherever it is found, e.g. ``ppo.learning_rate must be a number, got 'fast'
(str)`` in a params file and ``PPOConfig.learning_rate must be a number, got 'fast' (str)`` in Python.

Values are taken as YAML loaders give them: PyYAML reads ``1e-5`` as the *string* ``"1e-5"``, and ``dvc exp run
-S`` writes small floats that way, so a float (or int) field also takes a numeric string, and nothing else that is
not a number; an int field takes an integral float (``2.0``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any, Literal


class ConfigError(ValueError):
    """A bad value or key. ``key`` is the field's dotted name within its owner, ``problem`` a template of the
    message with ``{key}`` (and, for key suggestions, ``{prefix}``) left to fill: the same problem is then worded
    for the object (``PPOConfig.``) or the file section (``ppo.``) it was found in."""

    def __init__(self, key: str, problem: str, prefix: str = "PPOConfig."):
        self.key, self.problem = key, problem
        super().__init__(self.message(prefix))

    def message(self, prefix: str) -> str:
        """The message with ``prefix`` before every key it names."""
        return self.problem.format(key=prefix + self.key, prefix=prefix)


def _literal(text: Any) -> str:
    """``text`` as it should read in a message template (braces doubled: they are not placeholders)."""
    return str(text).replace("{", "{{").replace("}", "}}")


def _got(value: Any) -> str:
    return _literal(f"got {value!r} ({type(value).__name__})")


def check_keys(values: Iterable[str], known: Iterable[str], key_prefix: str = "", required: bool = False,
               renamed: dict[str, str] | None = None, settable: Iterable[str] | None = None) -> None:
    """Raise a ConfigError for the first key of ``values`` not in ``known`` (suggesting the closest key of
    ``settable``, default ``known``, or listing those: a key a user may not set is neither suggested nor listed;
    ``renamed``: another library's name for a known key, and what to write instead), and with ``required`` for the
    first key of ``known`` missing from ``values``."""
    values, known = list(values), list(known)
    offered = known if settable is None else list(settable)
    for key in values:
        if key in (renamed or {}):
            raise ConfigError(key_prefix + key, "unknown key '{key}'; " + renamed[key])
        if key not in known:
            close = difflib.get_close_matches(key, offered, n=1)
            hint = (f"did you mean '{{prefix}}{_literal(key_prefix + close[0])}'?" if close
                    else f"the keys here are {_literal([key_prefix + k for k in offered])}")
            raise ConfigError(key_prefix + key, "unknown key '{key}'; " + hint)
    if required:
        for key in known:
            if key not in values:
                raise ConfigError(key_prefix + key, "missing key '{key}'")


def _with_defaults(cls) -> set[str]:
    """The fields of dataclass ``cls`` that have a default."""
    return {f.name for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def checked(value: Any, hint: Any, key: str) -> Any:
    """``value`` checked against the annotation ``hint`` and converted (numeric strings to numbers, dataclass
    mappings to instances, recursively: every key required but those with a default, none unknown); a ConfigError
    naming ``key`` otherwise.

    Annotations understood: ``X | None`` / ``Optional[X]``, ``Literal[...]``, ``bool``, ``int``, ``float``,
    ``str``, ``dict`` (any mapping), ``dict[str, str]``, ``list[str]``, ``list[int]`` and dataclasses.
    """
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return checked(value, inner, key)
    if origin is Literal:
        if value not in args:
            raise ConfigError(key, f"{{key}} must be one of {_literal(list(args))}, {_got(value)}")
        return value
    if dataclasses.is_dataclass(hint):
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"{{key}} must be a mapping, {_got(value)}")
        hints = typing.get_type_hints(hint)
        check_keys(value, hints, key_prefix=f"{key}.")
        for name in hints:  # a field with a default (a key added later, off by default) may be left out
            if name not in value and name not in _with_defaults(hint):
                raise ConfigError(f"{key}.{name}", "missing key '{key}'")
        return hint(**{name: checked(value[name], hints[name], f"{key}.{name}") for name in hints if name in value})
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"{{key}} must be true or false, {_got(value)}")
        return value
    if hint in (int, float):
        return _number(value, hint, key)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"{{key}} must be a string, {_got(value)}")
        return value
    if hint is dict or origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(key, f"{{key}} must be a mapping, {_got(value)}")
        if args and not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ConfigError(key, f"{{key}} must be a mapping of strings to strings, {_got(value)}")
        return dict(value)
    if origin is list and args == (int,):
        if not isinstance(value, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise ConfigError(key, f"{{key}} must be a list of integers, {_got(value)}")
        return list(value)
    if origin is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(key, f"{{key}} must be a list of strings, {_got(value)}")
        return list(value)
    raise TypeError(f"{key}: unsupported annotation {hint!r}")  # a bug in the caller's dataclass, not user input


def _number(value: Any, kind: type, key: str) -> int | float:
    kind_name = "an integer" if kind is int else "a number"
    wrong = ConfigError(key, f"{{key}} must be {kind_name}, {_got(value)}")
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):  # NumPy scalars are numbers.Real
        raise wrong
    try:
        number = float(value) if isinstance(value, str) else value
    except ValueError:
        raise wrong from None
    if not math.isfinite(number):
        raise ConfigError(key, f"{{key}} must be a finite number, {_got(value)}")
    if kind is int:
        if float(number) != int(number):
            raise wrong
        return int(number)
    return float(number)


def check_range(key: str, value: Any, expected: str, ok: bool, advice: str = "") -> None:
    """Raise ``{key} must be {expected}, got {value}[; {advice}]`` unless ``ok`` (a range or a cross-field
    condition)."""
    if not ok:
        tail = f"; {advice}" if advice else ""
        raise ConfigError(key, f"{{key}} must be {_literal(expected)}, got {_literal(repr(value) + tail)}")
