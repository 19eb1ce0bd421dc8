"""The evaluation registry: each evaluation declares itself once, in one file of `diffexp/evals/tasks/`.

An evaluation is an `Evaluation` entry passed to `register`. From that one entry come `diffexp eval NAME`
(its options parsed from the dataclass, diffexp.evals.run), the fit-time callback
(`diffexp.evals.callback.Evaluate`), its scalars in TensorBoard, and its columns in `compare` and a sweep's
objectives (its `tags`). docs/evaluations.md, "Adding an evaluation", walks through one.

The entry's two functions split the work the way every evaluation needs it split:
- `inputs(options, context)` checks the options against the model and data (a `UserError` naming the flag
  through `context.flag(...)`) and builds what will be scored: prompts, batches, a task. It runs before the
  model is loaded and before any output exists, so a bad command changes no file.
- `score(model, inputs, options, context)` runs the model (a `Decoder` or the `DiffexpLM` that holds one, in
  eval mode, on `context.device`) and returns the results.

The results are any object with:
- `name`: the stem of its files and its place under a fit's log directory;
- `summary() -> str`: what the command prints;
- `scalars() -> dict[str, float]`: the figures, each tag starting with one of the entry's `tags`;
- `save(directory)`: its files (tables, CSV, plots);
- optionally `log_to_tensorboard(writer, step)`, for figures beyond the scalars (else the scalars are logged).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from diffexp.errors import UserError, as_written


def _allowed(hint: Any) -> str:
    """A type as a user reads it: `an integer`, `random or alternating`, `a list of numbers`, `... or null`."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        words = [str(arg) for arg in args]
        return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " or " + words[-1]
    if origin in (list, tuple):
        return f"a list, each {_allowed(args[0])}"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_allowed(arg) for arg in args)
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false",
            type(None): "null"}.get(hint, getattr(hint, "__name__", str(hint)))


def _fits(hint: Any, value: Any) -> bool:
    """Whether `value` (from YAML or the command line) is of the options field's type."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Literal:
        return value in args
    if origin in (list, tuple):
        return isinstance(value, (list, tuple)) and all(_fits(args[0], item) for item in value)
    if origin in (typing.Union, types.UnionType):
        return any(_fits(arg, value) for arg in args)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is type(None):
        return value is None
    return isinstance(value, hint) if isinstance(hint, type) else True


def option(default: Any, help: str, minimum: float | None = None, flag: str | None = None) -> Any:  # noqa: A002
    """A field of an evaluation's options dataclass: its default, its help line, and optionally the least value
    it (or each of its list's values) may take, checked wherever the options are made."""
    metadata = {"help": help, "minimum": minimum, "flag": flag}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class Evaluation:
    """Everything the rest of diffexp knows about one evaluation.

    Args:
        name: `diffexp eval NAME`, and the `evaluation:` of the fit-time callback.
        summary: one line for `diffexp eval --help`.
        paper: the measurement it reproduces, and where it comes from.
        options: a dataclass whose fields (made with `option`) are its flags, `--n-demos` for `n_demos`.
        inputs: (options, context) -> inputs; checks, and builds what is scored, before the model loads.
        score: (model, inputs, options, context) -> results (see the module's docstring).
        tags: the prefixes of its scalars (e.g. "needle/"): TensorBoard tags, compare columns, sweep objectives.
        reads_text: it feeds text through a tokenizer (the command gains --tokenizer).
        on_fit: it can score during training (its inputs need no checkpoint file).
    """

    name: str
    summary: str
    paper: str
    options: type
    inputs: Callable[[Any, Context], Any]
    score: Callable[[Any, Any, Any, Context], Any]
    tags: tuple[str, ...]
    reads_text: bool = False
    on_fit: bool = True

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.options):
            raise TypeError(f"evaluation {self.name!r}: options must be a dataclass, got {self.options!r}")
        if not self.tags or not all(isinstance(tag, str) and tag for tag in self.tags):
            raise TypeError(f"evaluation {self.name!r}: tags must name the prefixes of its scalars")

    def make_options(self, values: dict[str, Any], context: Context) -> Any:
        """The options dataclass from `values` (field name -> value), with unknown names and values below a
        field's minimum refused in the context's words (`--n-demos` on the command line, `options.n_demos`
        in a fit's callback)."""
        fields = {f.name: f for f in dataclasses.fields(self.options)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise UserError(f"{context.flag(unknown[0])}: not an option of evaluation {self.name!r}; allowed: "
                            f"{', '.join(context.flag(name) for name in fields)}")
        hints = typing.get_type_hints(self.options)
        for name, value in values.items():
            if not _fits(hints[name], value):
                raise UserError(f"{context.flag(name)}={as_written(value)} is invalid: expected "
                                f"{_allowed(hints[name])}")
            minimum = fields[name].metadata.get("minimum")
            if minimum is None or value is None:
                continue
            for item in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(item, (int, float)) and item < minimum:
                    allowed = "a positive integer" if minimum == 1 else f"a value >= {minimum}"
                    raise UserError(f"{context.flag(name)}={item} is invalid: expected {allowed}")
        return self.options(**values)


@dataclass
class Context:
    """What an evaluation knows besides its options: the model's settings and where it runs.

    Args:
        arch: the model's `model.arch` settings, as a dict.
        data: the training data module's init arguments ({} when unknown).
        step: the optimizer step of the weights scored.
        device: where the model runs.
        checkpoint: the checkpoint read (`diffexp eval`), None during a fit.
        checkpoint_path: CKPT as given (`diffexp eval`).
        tokenizer_flag: `--tokenizer`, when given.
        fit_tokenizer: during a fit, the data module's tokenizer.
        command: "eval" (flags `--n-demos`) or "fit" (keys `options.n_demos`).
    """

    arch: dict
    data: dict
    step: int
    device: Any = "cpu"
    checkpoint: dict | None = None
    checkpoint_path: str | None = None
    tokenizer_flag: str | None = None
    fit_tokenizer: Any = None
    command: str = "eval"
    _tokenizer: Any = field(default=None, repr=False)

    def flag(self, name: str) -> str:
        """An option as the user writes it here."""
        return f"--{name.replace('_', '-')}" if self.command == "eval" else f"options.{name}"

    def tokenizer(self):
        """The tokenizer the model reads: --tokenizer, else the checkpoint's own, else what its data names (a
        UserError if its ids do not fit the model); during a fit, the data module's (bytes if it has none)."""
        if self._tokenizer is None:
            if self.command == "fit":
                from diffexp.data.tokenizer import ByteTokenizer

                self._tokenizer = self.fit_tokenizer or ByteTokenizer()
            else:
                from diffexp.generate.cli import check_vocab, resolve_tokenizer

                hparams = {"arch": self.arch, "data": self.data}
                self._tokenizer = resolve_tokenizer(self.checkpoint or {}, hparams, self.tokenizer_flag)
                check_vocab(self._tokenizer, self.arch)
        return self._tokenizer


_ENTRIES: dict[str, Evaluation] = {}


def register(entry: Evaluation) -> Evaluation:
    """Adds an evaluation; returns it, so a module can keep it as a constant."""
    if not isinstance(entry, Evaluation):
        raise TypeError(f"register() takes an Evaluation, got {type(entry).__name__}")
    known = _ENTRIES.get(entry.name)
    if known is not None and known is not entry:
        raise ValueError(f"evaluation {entry.name!r} is already registered (by {known.score.__module__})")
    _ENTRIES[entry.name] = entry
    return entry


def unregister(name: str) -> None:
    """Removes an evaluation (for tests that register a temporary one)."""
    _ENTRIES.pop(name, None)


#: evaluations kept outside diffexp: `module:ATTRIBUTE` of an `Evaluation`, comma-separated; registered wherever
#: diffexp runs with it set (sweep trials and torchrun ranks inherit it)
EXTERNAL = "DIFFEXP_EVALUATIONS"
_external_loaded: set[str] = set()


def _load() -> None:
    import importlib
    import os

    from diffexp.evals import tasks  # noqa: F401  (importing the package registers every file in it)

    for spec in filter(None, (part.strip() for part in os.environ.get(EXTERNAL, "").split(","))):
        if spec in _external_loaded:
            continue
        module, _, attribute = spec.partition(":")
        try:
            entry = getattr(importlib.import_module(module), attribute or "EVALUATION")
        except (ImportError, AttributeError) as err:
            raise UserError(f"{EXTERNAL}={spec!r} is invalid: {err}; expected module:ATTRIBUTE naming an "
                            "Evaluation") from None
        if _ENTRIES.get(getattr(entry, "name", None)) is not entry:
            register(entry)
        _external_loaded.add(spec)


def evaluation_names() -> tuple[str, ...]:
    _load()
    return tuple(_ENTRIES)


def evaluation(name: str) -> Evaluation:
    """The entry of a registered evaluation; a UserError naming the known ones otherwise."""
    _load()
    if name not in _ENTRIES:
        raise UserError(f"evaluation {name!r} is not known; expected one of {', '.join(_ENTRIES)} "
                        "(`diffexp eval --help` describes them)")
    return _ENTRIES[name]


def evaluations() -> tuple[Evaluation, ...]:
    _load()
    return tuple(_ENTRIES.values())


def scalar_prefixes() -> tuple[str, ...]:
    """Every registered evaluation's tag prefixes: what a sweep may use as objective or compare column."""
    return tuple(tag for entry in evaluations() for tag in entry.tags)
