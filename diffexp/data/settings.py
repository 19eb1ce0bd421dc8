"""A preparation's settings (``prepare.json``) compared with another's, named as the user writes them: a rerun of
``diffexp data prepare`` into a directory with other settings, and ``join`` of parts prepared with other settings
(each unit's record keeps the settings it was made with).
"""

from __future__ import annotations

import json

# the settings in prepare.json a user chooses, as the data module's keys (`diffexp data` names its flags)
SETTING_KEYS = {"source.spec": "data.source", "source.text_field": "data.text_field",
                "source.max_chars": "data.max_chars", "tokenizer.spec": "data.tokenizer",
                "tokenizer.bpe.vocab_size": "data.bpe_vocab_size", "tokenizer.bpe.sample_chars": "bpe_sample_chars",
                "split.seed": "data.seed", "split.val_fraction": "data.val_fraction",
                "split.test_fraction": "data.test_fraction", "shard_tokens": "shard_tokens"}
# what follows from those settings and the corpus, named when no chosen setting explains a difference
DERIVED_NAMES = {"format": "the shard format", "source": "the source's content (its files' names, sizes and first "
                 "and last MiB)", "tokenizer": "the tokenizer", "split": "the held-out split",
                 "units": "the source's cutting into units (--unit-mb, or the corpus's size)"}


def _leaves(value, prefix: str = "") -> dict:
    """A nested settings dict as {dotted path: leaf value} (a section that is None, a byte tokenizer's `bpe`, is
    one leaf: its paths below read as None)."""
    if isinstance(value, dict):
        return {path: leaf for key, item in value.items() for path, leaf in _leaves(item, f"{prefix}{key}.").items()}
    return {prefix[:-1]: value}


def unit_settings(settings: dict) -> dict:
    """What each unit's record keeps of the settings: everything but the unit plan (the record holds its own
    unit) and the command (how it was spelled decides no byte)."""
    return {key: value for key, value in settings.items() if key not in ("units", "command")}


def settings_differences(saved: dict, wanted: dict, there_label: str = "there", now_label: str = "now") -> list[str]:
    """How two preparations' settings differ, each as `key=value there, value now`: the settings a user chooses
    first; the derived ones (the tokenizer's identity, the corpus, the unit plan) only when no chosen setting
    differs. The recorded command is no setting (how it was spelled decides no byte)."""
    keys = [key for key in wanted if key != "command"]
    there = _leaves({key: saved.get(key) for key in keys})
    now = _leaves({key: wanted[key] for key in keys})
    other_tokenizer = there.get("tokenizer.spec") != now.get("tokenizer.spec")  # its BPE settings follow from it
    chosen = [f"{name}={there.get(path)!r} {there_label}, {now.get(path)!r} {now_label}"
              for path, name in SETTING_KEYS.items()
              if there.get(path) != now.get(path) and not (other_tokenizer and path.startswith("tokenizer.bpe."))]
    if chosen:
        return chosen
    derived = []
    for key in keys:
        if saved.get(key) == wanted[key]:
            continue
        if key == "units":
            derived.append(f"{DERIVED_NAMES[key]}: {len(saved.get(key) or [])} units {there_label}, "
                           f"{len(wanted[key])} {now_label}")
            continue
        paths = sorted({p for p in {*there, *now} if p.split(".")[0] == key and there.get(p) != now.get(p)})
        shown = "; ".join(f"{p} {_short(there.get(p))} {there_label}, {_short(now.get(p))} {now_label}"
                          for p in paths[:3])
        derived.append(f"{DERIVED_NAMES.get(key, key)} ({shown})")
    return derived


def _short(value) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."
