"""A `model.arch` flag, declared once: its name, type, default and a one-line doc.

ModelConfig's fields, their validation, the CLI's help text and the refusal of a flag the chosen variant does not
read are all derived from these declarations. A variant declares its own flags in its registry entry.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, Union, get_args, get_origin


@dataclass(frozen=True)
class Flag:
    name: str
    type: Any  # bool, int, float, str, a Literal, or a Union of them (Optional included)
    default: Any
    doc: str
    #: the allowed values in words, where the type alone does not say them (a range, a meaning per choice)
    expected: str = ""
    #: a condition beyond the type (a range); the type is checked first
    valid: Callable[[Any], bool] | None = None

    def problem(self, value: Any) -> str | None:
        """None when `value` is allowed, else the "expected ..." of the error."""
        if matches(value, self.type) and (self.valid is None or self.valid(value)):
            return None
        return f"expected {self.expected or describe(self.type)}"

    @property
    def choices(self) -> tuple:
        """The values of a Literal flag (its Literal members for a Union)."""
        return tuple(a for t in _members(self.type) if get_origin(t) is Literal for a in get_args(t))


def _members(tp: Any) -> tuple:
    return get_args(tp) if get_origin(tp) in (Union, types.UnionType) else (tp,)


def matches(value: Any, tp: Any) -> bool:
    """Whether `value` is of the flag type `tp` (bools are not numbers; ints are floats)."""
    for member in _members(tp):
        if member is type(None) and value is None:
            return True
        if get_origin(member) is Literal and any(value == a and type(value) is type(a) for a in get_args(member)):
            return True
        if member is str and isinstance(value, str):
            return True
        if member is bool and isinstance(value, bool):
            return True
        if member is int and isinstance(value, int) and not isinstance(value, bool):
            return True
        if member is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return True
    return False


def describe(tp: Any) -> str:
    """The values of a flag type in words: "'same' or 'cross'", "true or false", "an integer or null"."""
    words = []
    for member in _members(tp):
        if get_origin(member) is Literal:
            words += [repr(a) for a in get_args(member)]
        else:
            words.append({bool: "true or false", int: "an integer", float: "a number", str: "a string",
                          type(None): "null"}[member])
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
