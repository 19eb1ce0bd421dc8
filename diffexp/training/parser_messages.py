"""jsonargparse's error messages in diffexp's words: one paragraph naming the key, the value as the user wrote
it (`null`, not None) and what is allowed. `fit`'s parser and `diffexp eval`'s options share it; it imports
neither Lightning nor torch (diffexp.training's plain modules load without them).
"""

from __future__ import annotations

import re

from diffexp.training.command_line import given_keys

_TYPE_WORDS = {"float": "a number", "int": "an integer", "str": "a string", "bool": "true or false",
               "NoneType": "null"}


def _readable_types(subtypes: str) -> str:
    """`[typing.Literal['depth'], float]` as a user reads it: `depth, or a number`."""
    words = []
    for literal, name in re.findall(r"(?:typing\.)?Literal\[(.*?)\]|([\w.]+)", subtypes):
        if literal:
            words += [w.strip().strip("'\"") for w in literal.split(",")]
        elif name:
            words.append(_TYPE_WORDS.get(name.split(".")[-1], name.split(".")[-1]))
    if not words:
        return subtypes
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]


#: Python's spelling of a parsed value -> the YAML word a user writes for it
_YAML_WORDS = {"None": "null", "True": "true", "False": "false"}


def _as_written(key: str, parsed: str, words: list[str]) -> str:
    """The value of `key` as the command line wrote it (`null`, not the parsed None), else the parsed value in YAML's
    words; quoted unless a YAML word (null, true, false)."""
    written = given_keys(words).get(key) or _YAML_WORDS.get(parsed, parsed)
    return written if written.lower() in {"null", "~", "true", "false"} else repr(written)


def clean_parser_message(message: str, words: list[str] = ()) -> str:
    """jsonargparse's message as one paragraph with the key and the value as the user writes them (`words`: the
    command line parsed)."""
    message = re.sub(r"<class '([\w.]+)'>", r"\1", message)
    message = re.sub(r'Parser key "([^"]+)":\s*', r"\1: ", message)
    message = re.sub(r"\s*\n\s*", " ", message).strip().replace("Expected a ", "expected ")
    choice = re.match(r"([\w.]+): expected (?:typing\.)?Literal\[(.*?)\]\.? Got value: (.*)$", message)
    if choice:  # a choice flag: the value given and the values allowed, not the Python type
        key, allowed, value = choice.groups()
        allowed = _readable_types(f"Literal[{allowed}]")
        return f"{key}: {_as_written(key, value, words)} is not allowed; allowed: {allowed}"
    union = re.match(r"([\w.]+): Does not validate against any of the Union subtypes Subtypes: \[(.*?)\] Errors:"
                     r".* Given value: (.*)$", message)
    if union:  # e.g. lambda_init: a word of a Literal or a number
        key, subtypes, value = union.groups()
        return f"{key}: {_as_written(key, value, words)} is not allowed; allowed: {_readable_types(subtypes)}"
    unknown = re.match(r"unrecognized arguments: (.*)", message)
    if unknown:
        keys = [arg.split("=", 1)[0] for arg in unknown.group(1).split() if arg.startswith("--")]
        message = f"unknown key(s) {', '.join(k.lstrip('-') for k in keys) or unknown.group(1)}"
    return message
