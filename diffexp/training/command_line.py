"""What a `fit`/`validate`/`test` command line names: its dotted keys as written, and its --config files.

The parsed config holds every key, defaults included; these say which keys the user gave, and how they wrote
each value (`null`, not Python's None), for messages that quote the user.
"""

from __future__ import annotations

from typing import Any

CONFIG_FLAG = "--config"


def given_keys(words: list[str]) -> dict[str, str]:
    """Each `--key value` or `--key=value` of `words` as key -> the value as written (the last one given);
    --config and words that are not flags are left out."""
    given: dict[str, str] = {}
    for i, word in enumerate(words):
        if not word.startswith("--") or word == "--":
            continue
        key, sep, value = word[2:].partition("=")
        if not sep:
            following = words[i + 1] if i + 1 < len(words) else ""
            value = following if not following.startswith("--") else ""
        if key and key != CONFIG_FLAG[2:]:
            given[key] = value
    return given


def config_files(words: list[str]) -> list[str]:
    """The files of the --config flags of `words`, in order."""
    files = []
    for i, word in enumerate(words):
        if word == CONFIG_FLAG and i + 1 < len(words):
            files.append(words[i + 1])
        elif word.startswith(CONFIG_FLAG + "="):
            files.append(word[len(CONFIG_FLAG) + 1:])
    return files


def file_setting(path: str, key: str) -> tuple[bool, Any]:
    """(whether the YAML config file at `path` sets the dotted `key`, its value there); (False, None) when it does
    not or cannot be read (parsing reports an unreadable file)."""
    import yaml

    try:
        with open(path) as handle:
            node = yaml.safe_load(handle)
    except (OSError, yaml.YAMLError):
        return False, None
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node
