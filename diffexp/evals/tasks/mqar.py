"""MQAR: multi-query associative recall accuracy (zoology) on held-out sequences.

The sequences are `MQARDataModule`'s validation stream. Each shape option left out is the model's own training
data's, when it was trained on MQAR (so during a fit it scores the sequences its validation loss reads), else
zoology's 256 tokens and 16 pairs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from diffexp.errors import UserError
from diffexp.evals.registry import Context, Evaluation, option, register

DEFAULTS = {"seq_len": 256, "num_kv_pairs": 16, "val_size": 1000, "seed": 1234}


@dataclass
class MQAROptions:
    seq_len: int | None = option(None, "tokens the model sees per sequence (default: its MQAR training data's, "
                                       "else 256)", minimum=1)
    num_kv_pairs: int | None = option(None, "key-value pairs per sequence (default: its training data's, else 16)",
                                      minimum=1)
    samples: int | None = option(None, "held-out sequences scored (default 1000)", minimum=1)
    seed: int | None = option(None, "seeds the sequences (default: its training data's, else 1234)")


@dataclass
class MQARResults:
    accuracy: float
    n: int
    seq_len: int
    num_kv_pairs: int

    @property
    def name(self) -> str:
        return f"mqar-seq{self.seq_len}-kv{self.num_kv_pairs}"

    def scalars(self) -> dict[str, float]:
        return {"mqar/accuracy": self.accuracy, f"mqar/accuracy_seq{self.seq_len}_kv{self.num_kv_pairs}": self.accuracy}

    def summary(self) -> str:
        return json.dumps({"mqar/accuracy": self.accuracy, "mqar/n": self.n})

    def save(self, directory) -> Path:
        path = Path(directory) / f"{self.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"mqar/accuracy": self.accuracy, "mqar/n": self.n}, indent=2))
        return path


def inputs(options: MQAROptions, context: Context):
    from diffexp.data.mqar import MQARDataModule
    from diffexp.evals.common import as_flags, at_most_max_seq_len

    trained = context.data if "num_kv_pairs" in context.data else {}
    shape = {key: trained.get(key, default) for key, default in DEFAULTS.items()}
    given = {"seq_len": options.seq_len, "num_kv_pairs": options.num_kv_pairs, "val_size": options.samples,
             "seed": options.seed}
    shape.update({key: value for key, value in given.items() if value is not None})
    if options.samples is None:
        shape["val_size"] = DEFAULTS["val_size"]
    at_most_max_seq_len(context.flag("seq_len"), shape["seq_len"], context.arch)
    names = {"seq_len": context.flag("seq_len"), "num_kv_pairs": context.flag("num_kv_pairs"),
             "val_size": context.flag("samples"), "vocab_size": "the model's model.arch.vocab_size"}
    try:
        return MQARDataModule(vocab_size=context.arch["vocab_size"], power_a=trained.get("power_a", 0.01),
                              batch_size=trained.get("batch_size", 64), **shape)
    except ValueError as err:
        raise UserError(as_flags(str(err), names)) from None


def score(model, data, options: MQAROptions, context: Context) -> MQARResults:
    from diffexp.evals.mqar import evaluate_mqar

    result = evaluate_mqar(model, data, device=context.device)
    return MQARResults(result["mqar/accuracy"], result["mqar/n"], data.seq_len, data.num_kv_pairs)


MQAR = register(Evaluation(
    name="mqar",
    summary="multi-query associative recall accuracy on held-out MQAR sequences",
    paper="Zoology (Arora et al. 2023), the recall benchmark the differential papers' retrieval claims rest on.",
    options=MQAROptions, inputs=inputs, score=score, tags=("mqar/",),
))
