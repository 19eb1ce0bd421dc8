"""User errors: one clear paragraph on stderr, no traceback, exit code 2.

Anything the user can fix (a config value, a file, a checkpoint, a sweep spec, a storage URL) raises
`UserError` with a message that names the key as the user writes it, the bad value and what is
allowed. Every `diffexp` subcommand runs under `guarded`, which prints that message and exits 2.
`DIFFEXP_DEBUG=1` re-raises instead, with the full traceback.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from typing import Any

EXIT_USER_ERROR = 2


class UserError(ValueError):
    """A problem with what the user asked for. A ValueError, so callers that catch ValueError still work."""


#: an option's name (`text_file`) as the user writes it where the code runs: `--text-file` on the command line
#: (`cli_flag`), `options.text_file` under an evaluation's callback in a fit (diffexp.evals.registry.Context.flag)
Flag = Callable[[str], str]


def cli_flag(name: str) -> str:
    """An option's name as a command-line flag: `--text-file` for `text_file`."""
    return f"--{name.replace('_', '-')}"


def as_written(value: Any) -> str:
    """A value as a user writes it in a config or on the command line: null, true and false as YAML spells them
    (not Python's None, True, False), anything else as its repr."""
    if value is None:
        return "null"
    return ("true" if value else "false") if isinstance(value, bool) else repr(value)


def invalid(key: str, value: Any, allowed: str) -> UserError:
    """`key=value is invalid: allowed`, the one shape of every bad-value message."""
    return UserError(f"{key}={as_written(value)} is invalid: {allowed}")


def dash_value_hint(message: str, argv: list[str]) -> str:
    """For argparse's "argument --key: expected one argument" where the word after --key starts with "-" (a
    negative number such as -1e-3 is read as an option): the --key=value form that passes it, else ""."""
    import re

    found = re.search(r"argument (--[\w.\-]+)(?:/\S+)?: expected one argument", message)
    if not found:
        return ""
    key = found.group(1)
    following = [argv[i + 1] for i, word in enumerate(argv[:-1]) if word == key]
    if not following or not following[-1].startswith("-"):
        return ""
    return (f"; {key} {following[-1]}: a value that starts with '-' is read as an option, so write it as "
            f"{key}={following[-1]}")


def debug_enabled() -> bool:
    return os.environ.get("DIFFEXP_DEBUG", "").strip().lower() not in ("", "0", "false", "no")


def print_error(message: str) -> None:
    """Write `error: message` to stderr as plain text: never wrapped, so paths and URLs stay whole."""
    from diffexp.secrets import mask_secrets

    text = mask_secrets(str(message)).strip()
    sys.stderr.write(f"error: {text}\n")
    if not debug_enabled():
        sys.stderr.write("(DIFFEXP_DEBUG=1 shows the traceback)\n")
    sys.stderr.flush()


def guarded(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call fn; a UserError becomes `error: ...` on stderr and SystemExit(2) (re-raised under DIFFEXP_DEBUG)."""
    try:
        return fn(*args, **kwargs)
    except UserError as err:
        if debug_enabled():
            raise
        print_error(str(err))
        raise SystemExit(EXIT_USER_ERROR) from None
