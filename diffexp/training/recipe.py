"""A recipe read as `diffexp fit` reads it, without Lightning, for `diffexp params`, which then starts in about the
time of `import torch` (fit's LightningCLI parser imports Lightning, jsonargparse and every data module).

`read_recipe(FILES)` merges the YAML files in order, as fit's `--config FILE ...` does: a later file's key
overrides an earlier one's, a mapping merges key by key, a list is replaced whole. It returns, as plain dicts,
lists and tuples (what `to_builtin` makes of fit's parsed config), the sections that decide a model's size and
its run's budget, each key checked and each default filled in from where fit takes it:

- model: DiffexpLM's arguments; model.arch the flags of ModelConfig, model.optim OptimConfig's fields,
  model.ar_hit ARHitConfig's, then the checks each dataclass runs;
- data: the data module's class_path (TextDataModule by default) and every argument of its __init__, read from
  the class's source (a diffexp data module, so nothing is imported);
- trainer: max_steps (fit's default, TRAINER_DEFAULTS, when unset), and accumulate_grad_batches and strategy
  when set; the values fit checks before any work (trainer_checks.check_trainer: max_steps 0, a negative
  gradient_clip_val, ...) are refused in fit's words;
- global_batch: rows.

An unknown key in those sections is refused (UserError: the key as written, the file, the keys allowed). What
only fit's parser can judge raises NeedsFitParser instead, and the caller reads the recipe with fit's parser
(diffexp.training.cli.parse_config): a key outside the sections above and TRAINER_KEYS, a value of another type
than its key's (jsonargparse converts some, as "128" or 1e-3 for a number), a class outside diffexp, a class_path
that a later file changes, ckpt_path, a key of checkpoint.*, diagnostics.* or throughput.* that their class does
not take. The rest of a recipe (the other trainer settings, the logger, the callbacks, the values of checkpoint.*,
diagnostics.*, throughput.*) changes no count or budget; their values are fit's to check when it builds the run.
tests/test_recipe_reader.py checks that every recipe under recipes/ reads as fit's parser reads it.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal, Union

from diffexp.errors import UserError

#: fit's Trainer defaults (diffexp.training.cli passes them to LightningCLI)
TRAINER_DEFAULTS = {
    "max_steps": 300,
    "val_check_interval": 100,
    "check_val_every_n_epoch": None,
    "limit_val_batches": 20,
    "log_every_n_steps": 10,
    "gradient_clip_val": 1.0,
    "num_sanity_val_steps": 0,
    "enable_model_summary": False,  # DiffexpLM prints its own parameter report (Lightning's shows "FLOPs 0")
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs", "name": "default", "default_hp_metric": False},
    },
}
#: the data module of a recipe without data.class_path (diffexp.training.cli sets it as fit's default)
DEFAULT_DATA_CLASS = "diffexp.data.TextDataModule"
#: the LightningModule every run trains
MODEL_CLASS = "diffexp.training.module.DiffexpLM"
#: DiffexpLM's arguments that fit links from the data module (model.vocab_size from data.vocab_size): its parser
#: has no default for them and keeps a value a recipe gives, which the link replaces when the model is built
LINKED_MODEL_KEYS = ("vocab_size",)
#: the Trainer arguments read here (they decide the budget and the memory per rank)
TRAINER_READ = ("max_steps", "accumulate_grad_batches", "strategy")
#: Trainer arguments passed through unread (their values are fit's to check); a recipe with a trainer key outside
#: these and TRAINER_READ goes to fit's parser. Each is an argument of Lightning's Trainer (tests/test_recipe_reader.py)
TRAINER_KEYS = TRAINER_READ + (
    "accelerator", "devices", "num_nodes", "precision", "logger", "callbacks", "fast_dev_run", "max_epochs",
    "min_epochs", "min_steps", "max_time", "limit_train_batches", "limit_val_batches", "limit_test_batches",
    "val_check_interval", "check_val_every_n_epoch", "num_sanity_val_steps", "log_every_n_steps",
    "enable_checkpointing", "enable_progress_bar", "enable_model_summary", "gradient_clip_val",
    "gradient_clip_algorithm", "deterministic", "benchmark", "default_root_dir",
)
#: the top-level keys of fit's config read here; the other keys passed through unread (seed_everything and
#: diffexp's callbacks' settings: no count or budget depends on them); any other goes to fit's parser
READ_SECTIONS = ("model", "data", "trainer", "global_batch")
UNREAD_SECTIONS = ("seed_everything", "checkpoint", "diagnostics", "throughput")
#: the sections of the callbacks fit always adds (diffexp.training.cli), whose keys are checked, not their values
CALLBACK_SECTIONS = ("checkpoint", "diagnostics", "throughput")
CALLBACK_CLASSES = {"diagnostics": "diffexp.training.diagnostics.Diagnostics",
                    "throughput": "diffexp.training.throughput.Throughput"}
#: the arguments of checkpoint.* (RunCheckpoint takes ModelCheckpoint's; tests/test_recipe_reader.py checks each)
CHECKPOINT_KEYS = ("dirpath", "filename", "monitor", "verbose", "save_last", "save_top_k", "save_on_exception",
                   "save_weights_only", "mode", "auto_insert_metric_name", "every_n_train_steps",
                   "train_time_interval", "every_n_epochs", "save_on_train_epoch_end", "enable_version_counter")
#: the class whose arguments global_batch holds
GLOBAL_BATCH_CLASS = "diffexp.training.global_batch.GlobalBatch"


class NeedsFitParser(Exception):
    """The recipe holds something only fit's parser can judge (the message says what): read it with that."""


def load_config_file(path: str | Path, label: str = "--config",
                     example: str = "a YAML recipe such as recipes/tiny/<variant>.yaml") -> dict:
    """The mapping a config file holds ({} for an empty file); a missing file, bad YAML or a file that holds no
    mapping is a UserError naming `label` and the file (jsonargparse's own messages do not name it)."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise UserError(f"{label} {path}: no such file" + (" (a directory)" if file.is_dir() else "") +
                        f"; expected {example}")
    try:
        loaded = yaml.safe_load(file.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        where = getattr(err, "problem_mark", None)
        line = f" at line {where.line + 1}" if where is not None else ""
        raise UserError(f"{label} {path}: not valid YAML{line} ({getattr(err, 'problem', None) or err}); "
                        "expected a mapping of keys such as model:, data:, trainer:") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise UserError(f"{label} {path}: holds a {type(loaded).__name__}, expected a mapping of keys such as "
                        "model:, data:, trainer:")
    return loaded or {}


def read_recipe(files: Sequence[str | Path], label: str = "RECIPE") -> dict:
    """The model, data, trainer and global_batch sections of fit's config for `--config FILE ...` (module doc)."""
    loaded = [(str(path), load_config_file(path, label)) for path in files]
    for _, content in loaded:
        for key in content:
            if key not in READ_SECTIONS + UNREAD_SECTIONS:
                raise NeedsFitParser(f"the top-level key {key!r}")
            if key == "data" and isinstance(content[key], dict):
                content[key] = _as_class_spec(content[key], "data")
    merged: dict = {}
    for _, content in loaded:
        merged = _merge(merged, content, "")
    where = _Where(label, loaded)
    for section in CALLBACK_SECTIONS:
        if section in merged:
            _callback_settings(section, merged[section])
    return {"model": _model(merged.get("model", {}), where),
            "data": _data(merged.get("data", {}), where),
            "trainer": _trainer(merged.get("trainer", {})),
            "global_batch": _object(_signature(GLOBAL_BATCH_CLASS), merged.get("global_batch", {}), "global_batch",
                                    where)}


class _Where:
    """Names the file(s) that hold a key, for the message that refuses it."""

    def __init__(self, label: str, loaded: list[tuple[str, dict]]) -> None:
        self.label, self.loaded = label, loaded

    def files(self, key: str) -> str:
        parts = key.split(".")
        if parts[0] == "data":  # read_recipe holds a data section as {class_path, init_args}
            parts.insert(1, "init_args")
        holding = []
        for name, content in self.loaded:
            value: Any = content
            for part in parts:
                if not isinstance(value, dict) or part not in value:
                    break
                value = value[part]
            else:
                holding.append(name)
        return f"{self.label} {', '.join(holding) or self.loaded[-1][0]}"


def _as_class_spec(section: dict, key: str) -> dict:
    """A class section as {class_path?, init_args}: a mapping without class_path and init_args holds the
    init_args themselves (fit's default class); class_path beside init arguments is left to fit's parser."""
    if "class_path" not in section and "init_args" not in section:
        return {"init_args": section}
    if set(section) - {"class_path", "init_args"}:
        raise NeedsFitParser(f"{key}: init arguments beside class_path")
    return section


def _merge(base: Any, over: Any, key: str) -> Any:
    """`over` merged into `base` as a later --config file is: mappings key by key, anything else replaced."""
    if not (isinstance(base, dict) and isinstance(over, dict)):
        return over
    if "class_path" in over:  # another class than an earlier file's (or than the default its init_args are for)
        earlier = base.get("class_path")
        if earlier is not None and earlier != over["class_path"] or earlier is None and base.get("init_args"):
            raise NeedsFitParser(f"{key}.class_path set to {over['class_path']!r} over an earlier file's class")
    merged = dict(base)
    for name, value in over.items():
        merged[name] = _merge(base.get(name), value, f"{key}.{name}".lstrip("."))
    return merged


# -- the arguments of a class, read from its source ------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Argument:
    type: Any
    default: Any  # a value, or a dataclass type whose defaults it takes


def _signature(class_path: str, base: str | None = None) -> dict[str, _Argument]:
    """The __init__ arguments of a diffexp class, from its module's source (nothing imported but the packages
    above it). `base`: the class must name a base class ending so (LightningDataModule)."""
    node = _class_node(class_path)
    if base is not None and not any(ast.unparse(b).endswith(base) for b in node.bases):
        raise NeedsFitParser(f"{class_path} is no {base} by its source")
    init = next((n for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None)
    if init is None or init.args.vararg or init.args.kwarg or init.args.posonlyargs:
        raise NeedsFitParser(f"{class_path}.__init__ takes arguments that are not named in its signature")
    positional = init.args.args[1:]
    defaults = [None] * (len(positional) - len(init.args.defaults)) + list(init.args.defaults)
    arguments = {}
    for arg, default in [*zip(positional, defaults), *zip(init.args.kwonlyargs, init.args.kw_defaults)]:
        if default is None or arg.annotation is None:
            raise NeedsFitParser(f"{class_path}: argument {arg.arg} without a default or a type")
        arguments[arg.arg] = _Argument(_type(arg.annotation, class_path), _default(default, class_path))
    return arguments


def _class_node(class_path: str) -> ast.ClassDef:
    """The ClassDef of `module.Class`, following an import of it (diffexp.data's lazy TextDataModule)."""
    module, _, name = class_path.rpartition(".")
    if not module.startswith("diffexp.") or not name:
        raise NeedsFitParser(f"the class {class_path!r}, outside diffexp")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        raise NeedsFitParser(f"the class {class_path!r}: no module {module!r}")
    tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and any(a.name == name and a.asname is None
                                                                     for a in node.names):
            return _class_node(f"{node.module}.{name}")
    raise NeedsFitParser(f"the class {class_path!r}: not in {module}")


def _dataclasses() -> dict[str, type]:
    from diffexp.model.config import ModelConfig
    from diffexp.training.options import ARHitConfig, OptimConfig

    return {"ModelConfig": ModelConfig, "OptimConfig": OptimConfig, "ARHitConfig": ARHitConfig}


_NAMES = {"int": int, "float": float, "str": str, "bool": bool, "None": type(None)}


def _type(node: ast.expr, where: str) -> Any:
    """A type annotation's AST as the type: int, float, str, bool, None, Literal, X | Y, Optional, list[...],
    tuple[...] and diffexp's config dataclasses; any other makes the class fit's parser's to read."""
    if isinstance(node, ast.Constant) and node.value is None:
        return type(None)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a quoted annotation
        return _type(ast.parse(node.value, mode="eval").body, where)
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.Name) and node.id in _dataclasses():
        return _dataclasses()[node.id]
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return Union[_type(node.left, where), _type(node.right, where)]
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
        if node.value.id == "Literal":
            return Literal[tuple(ast.literal_eval(item) for item in items)]
        if node.value.id == "Optional":
            return Union[_type(items[0], where), None]
        if node.value.id == "list" and len(items) == 1:
            return list[_type(items[0], where)]
        if node.value.id == "tuple" and not any(isinstance(i, ast.Constant) and i.value is ... for i in items):
            return tuple[tuple(_type(item, where) for item in items)]
    raise NeedsFitParser(f"{where}: the type {ast.unparse(node)}")


def _default(node: ast.expr, where: str) -> Any:
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _dataclasses() \
            and not node.args and not node.keywords:
        return _dataclasses()[node.func.id]
    try:
        return ast.literal_eval(node)
    except ValueError:
        raise NeedsFitParser(f"{where}: the default {ast.unparse(node)}") from None


# -- values -----------------------------------------------------------------------------------------------------

class _Mismatch(Exception):
    pass


def _conform(value: Any, tp: Any) -> Any:
    """`value` as fit's parser holds it for type `tp` (an int for a float is a float, a list for a tuple a tuple), or
    _Mismatch when its type is not `tp`'s as written: jsonargparse may convert it, so fit's parser judges."""
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        for member in typing.get_args(tp):
            try:
                return _conform(value, member)
            except _Mismatch:
                pass
        raise _Mismatch
    if origin is Literal:
        if any(value == allowed and type(value) is type(allowed) for allowed in typing.get_args(tp)):
            return value
        raise _Mismatch
    if origin is list and isinstance(value, list):
        (item,) = typing.get_args(tp)
        return [_conform(v, item) for v in value]
    if origin is tuple and isinstance(value, (list, tuple)) and len(value) == len(typing.get_args(tp)):
        return tuple(_conform(v, item) for v, item in zip(value, typing.get_args(tp)))
    if tp is type(None) and value is None or tp is bool and isinstance(value, bool) \
            or tp is str and isinstance(value, str):
        return value
    if tp in (int, float) and isinstance(value, int) and not isinstance(value, bool):
        return tp(value)
    if tp is float and isinstance(value, float):
        return value
    raise _Mismatch


def _unknown(given: dict, allowed: Sequence[str], section: str, where: _Where, owner: str) -> None:
    """Refuse the keys of `given` that `allowed` lacks: each as written, with the nearest allowed key."""
    unknown = [key for key, value in given.items() if key not in allowed and value != {}]  # {}: no key, to fit too
    if not unknown:
        return
    import difflib

    keys = [f"{section}.{key}" for key in unknown]
    hints = [f"{key}: did you mean {section}.{close[0]}?" for key, name in zip(keys, unknown)
             if (close := difflib.get_close_matches(name, list(allowed), n=1, cutoff=0.75))]
    raise UserError(f"{where.files(keys[0])}: unknown key(s) {', '.join(keys)}" + "".join(f"; {h}" for h in hints)
                    + f"; {section} holds the arguments of {owner}: {', '.join(allowed)}")


def _object(arguments: dict[str, _Argument], given: Any, section: str, where: _Where, owner: str = "") -> dict:
    """A section's every argument, the recipe's value where it gives one, else the default."""
    if not isinstance(given, dict):  # null too: fit's parser says what it means
        raise NeedsFitParser(f"{section}: {given!r}, not a mapping")
    _unknown(given, list(arguments), section, where, owner or _owner(section))
    values = {}
    for name, argument in arguments.items():
        if isinstance(argument.type, type) and dataclasses.is_dataclass(argument.type):
            values[name] = _dataclass(argument.type, given.get(name, {}), f"{section}.{name}", where)
        elif name in given:
            try:
                values[name] = _conform(given[name], argument.type)
            except _Mismatch:
                raise NeedsFitParser(f"{section}.{name}: {given[name]!r}") from None
        else:
            values[name] = argument.default
    return values


def _owner(section: str) -> str:
    return {"global_batch": GLOBAL_BATCH_CLASS.rpartition(".")[2], "model": "DiffexpLM"}.get(section, section)


def _dataclass(cls: type, given: Any, section: str, where: _Where) -> dict:
    """A config dataclass's fields, each checked by the dataclass itself (its UserErrors are fit's too)."""
    if cls.__name__ == "ModelConfig":
        from diffexp.model.config import all_flags

        types_ = {flag.name: flag.type for flag in all_flags()}
    else:
        types_ = typing.get_type_hints(cls)
    arguments = {f.name: _Argument(types_[f.name], f.default if f.default is not dataclasses.MISSING
                                   else f.default_factory()) for f in dataclasses.fields(cls)}
    owner = cls.__name__ + (" (`diffexp variants` lists the flags each variant reads)"
                            if cls.__name__ == "ModelConfig" else "")
    return dataclasses.asdict(cls(**_object(arguments, given, section, where, owner)))


def _model(given: Any, where: _Where) -> dict:
    arguments = {name: argument for name, argument in _signature(MODEL_CLASS).items()
                 if name not in LINKED_MODEL_KEYS or isinstance(given, dict) and name in given}
    return _object(arguments, given, "model", where)


def _data(given: Any, where: _Where) -> dict:
    if not isinstance(given, dict):
        raise NeedsFitParser(f"data: {given!r}, not a mapping")
    class_path = given.get("class_path", DEFAULT_DATA_CLASS)
    if not isinstance(class_path, str):
        raise NeedsFitParser(f"data.class_path {class_path!r}")
    arguments = _signature(class_path, base="LightningDataModule")
    init_args = _object(arguments, given.get("init_args", {}), "data", where, class_path)
    return {"class_path": class_path, "init_args": init_args}


def _trainer(given: Any) -> dict:
    """The trainer settings read (TRAINER_READ), fit's default max_steps where unset; the values fit checks before
    any work (trainer_checks.check_trainer) are checked as fit checks them."""
    from diffexp.training.trainer_checks import CHECKED_TYPES, check_trainer

    if not isinstance(given, dict):
        raise NeedsFitParser(f"trainer: {given!r}, not a mapping")
    unknown = [key for key in given if key not in TRAINER_KEYS]
    if unknown:
        raise NeedsFitParser(f"trainer.{unknown[0]}")
    checked = {"max_steps": TRAINER_DEFAULTS["max_steps"]}
    for key, tp in CHECKED_TYPES.items():
        if key in given:
            try:
                checked[key] = _conform(given[key], tp)
            except _Mismatch:
                raise NeedsFitParser(f"trainer.{key}: {given[key]!r}") from None
    check_trainer(checked, "fit")
    read = {key: checked[key] for key in ("max_steps", "accumulate_grad_batches") if key in checked}
    if "strategy" in given:
        read["strategy"] = _strategy(given["strategy"])
    return read


def _callback_settings(section: str, given: Any) -> None:
    """checkpoint.*, diagnostics.* and throughput.* change no figure, so their values are fit's to check; a key
    their class does not take is a recipe fit refuses, which fit's parser then words."""
    if not isinstance(given, dict):
        raise NeedsFitParser(f"{section}: {given!r}, not a mapping")
    accepted = CHECKPOINT_KEYS if section == "checkpoint" else tuple(_signature(CALLBACK_CLASSES[section]))
    unknown = [key for key in given if key not in accepted]
    if unknown:
        raise NeedsFitParser(f"{section}.{unknown[0]}")


def _strategy(strategy: Any) -> Any:
    """A strategy's name, or its class_path and the init_args given (activation_checkpointing read: a bool)."""
    if isinstance(strategy, str):
        return strategy
    if not isinstance(strategy, dict) or not isinstance(strategy.get("class_path"), str) \
            or set(strategy) - {"class_path", "init_args"} or not isinstance(strategy.get("init_args", {}), dict):
        raise NeedsFitParser(f"trainer.strategy: {strategy!r}")
    init_args = strategy.get("init_args", {})
    if not isinstance(init_args.get("activation_checkpointing", False), bool):
        raise NeedsFitParser(f"trainer.strategy.init_args.activation_checkpointing: "
                             f"{init_args['activation_checkpointing']!r}")
    return {"class_path": strategy["class_path"], "init_args": dict(init_args)}
