"""`diffexp eval NAME CKPT [options]`: any registered evaluation on a saved checkpoint.

The options come from the entry's dataclass, parsed by jsonargparse (the config system of `fit`), with errors in
fit's form: one paragraph naming the flag, the value as written, and what is allowed. The order is every
evaluation's: read the checkpoint, check the options and make the inputs, and only then load the model and
open the outputs (<run>/eval/ or --out, and the run's TensorBoard at the checkpoint's step).
"""

from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from typing import Any

from diffexp.errors import UserError, cli_flag, debug_enabled
from diffexp.evals.layout import EVAL_SCALARS_SUFFIX
from diffexp.evals.registry import Context, Evaluation
from diffexp.training.parser_messages import clean_parser_message

CKPT_KEY = "CKPT"
COMMON = ("checkpoint", "device", "out", "tokenizer", "config")


def _list_item(hint: Any) -> Any | None:
    """X for list[X] (also within X | None), else None."""
    if typing.get_origin(hint) in (list, tuple):
        return typing.get_args(hint)[0]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        for arg in typing.get_args(hint):
            if typing.get_origin(arg) in (list, tuple):
                return typing.get_args(arg)[0]
    return None


def _is_bool(hint: Any) -> bool:
    return hint is bool or set(typing.get_args(hint)) == {bool, type(None)}


def build_parser(entry: Evaluation):
    """jsonargparse's parser of `diffexp eval NAME`: CKPT, a flag per options field, and the shared flags."""
    from jsonargparse import ActionConfigFile, ActionYesNo, ArgumentParser

    class EvalParser(ArgumentParser):
        words: list[str] = []
        list_flags: set[str] = set()

        def error(self, message: str, ex: Exception | None = None):
            if debug_enabled():
                return super().error(message, ex)
            text = parse_message(message, self.words)
            text += swallowed_checkpoint(text, self.words, self.list_flags, self.prog)
            raise UserError(f"{text} (`{self.prog} --help` lists its options)") from None

    parser = EvalParser(prog=f"diffexp eval {entry.name}", description=f"{entry.summary}. {entry.paper}",
                        allow_abbrev=False, exit_on_error=False)
    parser.add_argument("checkpoint", metavar=CKPT_KEY, type=str,
                        help="a .ckpt file, a sharded checkpoint directory or a `diffexp export` directory")
    hints = typing.get_type_hints(entry.options)
    for spec in dataclasses.fields(entry.options):
        hint, kwargs = hints[spec.name], {"help": spec.metadata.get("help", "")}
        default = spec.default if spec.default is not dataclasses.MISSING else spec.default_factory()
        item = _list_item(hint)
        if _is_bool(hint):
            parser.add_argument(cli_flag(spec.name), action=ActionYesNo(no_prefix="no-"), default=default, **kwargs)
        elif item is not None:
            parser.add_argument(cli_flag(spec.name), type=item, nargs="+", default=default, **kwargs)
            parser.list_flags = parser.list_flags | {cli_flag(spec.name)}
        else:
            parser.add_argument(cli_flag(spec.name), type=hint, default=default, **kwargs)
    if entry.reads_text:
        parser.add_argument("--tokenizer", type=str | None, default=None,
                            help="'byte' or a tokenizer.json, for checkpoints saved without their tokenizer")
    parser.add_argument("--device", type=str | None, default=None, help="default: cuda when a GPU is there, else cpu")
    parser.add_argument("--out", type=str | None, default=None,
                        help="the output directory (default: <run>/eval/ beside the checkpoint's checkpoints/)")
    parser.add_argument("--config", action=ActionConfigFile, help="a YAML file of these options")
    return parser


_TYPES = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def parse_message(message: str, words: list[str]) -> str:
    """jsonargparse's message with the options' names as flags (`--n-demos`, not `n_demos`)."""
    message = re.sub(r'(Parser key "[^"]+") element \d+:', r"\1:", message)
    text = clean_parser_message(message, words)
    if re.fullmatch(r"the following arguments are required: checkpoint", text):
        return f"{CKPT_KEY} is required: a checkpoint to evaluate, the first word after the evaluation's name"
    typed = re.match(r"([\w]+): expected ([\w.]+)\. Got value: (.*)$", text)
    if typed:
        key, kind, value = typed.groups()
        return f"{cli_flag(key)}={value!r} is invalid: expected {_TYPES.get(kind, kind)}"
    text = re.sub(r"unknown key\(s\) ([\w, -]+)", lambda m: "unknown option(s) " + ", ".join(
        "--" + key.strip() for key in m.group(1).split(",")), text)
    return re.sub(r"^(\w+):", lambda m: cli_flag(m.group(1)) + ":", text)


def _checkpoint_like(word: str) -> bool:
    from pathlib import Path

    return word.endswith(".ckpt") or Path(word).expanduser().exists()


def swallowed_checkpoint(text: str, words: list[str], list_flags: set[str], prog: str) -> str:
    """For an error caused by CKPT written after a list option (`--bits 16 8 CKPT`: the list takes every word up
    to the next option, CKPT too): what happened and the orders that parse, else ""."""
    last_option = max((i for i, word in enumerate(words) if word.startswith("-")), default=None)
    if last_option is None or last_option == len(words) - 1 or words[last_option] not in list_flags:
        return ""
    key, values = words[last_option], words[last_option + 1:]
    if not _checkpoint_like(values[-1]):
        return ""
    if not (text.startswith(f"{key}={values[-1]!r} is invalid") or text.startswith(f"{CKPT_KEY} is required")):
        return ""  # refused for another reason
    listed = " ".join(values[:-1]) or "..."
    return (f"; {values[-1]!r} looks like {CKPT_KEY} but was read as one of {key}'s values (a list takes every word "
            f"up to the next option): give {CKPT_KEY} first ({prog} {CKPT_KEY} {key} {listed}), or end the list "
            f"with -- ({key} {listed} -- {CKPT_KEY}, as the last words)")


def parse(entry: Evaluation, argv: list[str]) -> tuple[dict, dict]:
    """(options field -> value, shared flag -> value) from the command line."""
    parser = build_parser(entry)
    parser.words = [str(word) for word in argv]
    namespace = parser.parse_args(argv).as_dict()
    namespace.pop("__path__", None)
    shared = {key: namespace.pop(key, None) for key in COMMON}
    return namespace, shared


def publish(results, writer, step: int) -> None:
    """The results' scalars (and figures, where it has them) into a TensorBoard writer at `step`."""
    if hasattr(results, "log_to_tensorboard"):
        results.log_to_tensorboard(writer, step)
        return
    for tag, value in results.scalars().items():
        writer.add_scalar(tag, value, step)


def run(entry: Evaluation, argv: list[str]) -> int:
    values, shared = parse(entry, argv)
    from diffexp.evals.common import check_out, eval_output
    from diffexp.training.loading import check_device, load_checkpoint, load_model

    checkpoint, hparams = load_checkpoint(shared["checkpoint"])
    import torch

    device = shared["device"] or ("cuda" if torch.cuda.is_available() else "cpu")
    context = Context(arch=hparams["arch"], data=hparams["data"], step=hparams["global_step"], device=device,
                      checkpoint=checkpoint, checkpoint_path=shared["checkpoint"],
                      tokenizer_flag=shared.get("tokenizer"), command="eval")
    options = entry.make_options(values, context)
    check_device(device)
    check_out(shared["out"])
    inputs = entry.inputs(options, context)
    model = load_model(checkpoint, shared["checkpoint"], device)
    results = entry.score(model, inputs, options, context)
    print(results.summary())
    out, writer, step = eval_output(shared["checkpoint"], shared["out"], context.step)
    results.save(out)
    scalars = {"step": step, "evaluation": entry.name, "scalars": results.scalars()}
    (out / f"{results.name}{EVAL_SCALARS_SUFFIX}").write_text(json.dumps(scalars, indent=2) + "\n")
    if writer is not None:
        publish(results, writer, step)
        writer.close()
    print(f"wrote {out}/{results.name}*")
    return 0
