"""Parsed configs and checkpoint hyperparameters as Python's built-in types (dicts, lists, scalars), and the
sections of a parsed config read through them."""

from __future__ import annotations

from typing import Any

JSON_SCALARS = (bool, int, float, str)


def to_builtin(value: Any, json_safe: bool = False) -> Any:
    """`value` with jsonargparse Namespaces and dicts as dicts and tuples as lists, recursively.

    json_safe: also keys as strings and any other value JSON cannot hold as its repr (for a config.json)."""
    if hasattr(value, "as_dict"):
        return value.as_dict()
    if isinstance(value, dict):
        return {(str(k) if json_safe else k): to_builtin(v, json_safe) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_builtin(v, json_safe) for v in value]
    if json_safe and not (value is None or isinstance(value, JSON_SCALARS)):
        return repr(value)
    return value


def data_init_args(config) -> tuple[str | None, dict[str, Any]]:
    """(class path, init args) of the data module section of a parsed config (fit's, or read_recipe's)."""
    data = to_builtin(config.get("data") or {})
    if "class_path" in data:
        return data["class_path"], dict(data.get("init_args") or {})
    return None, dict(data)
