"""Evaluations the papers use: needle retrieval, attention noise, MQAR, in-context learning, loss by position.

(The AR-Hit / Others split of the validation loss is logged by training: diffexp.training.loss_slices.)"""


def __getattr__(name: str):
    """`diffexp.evals.Evaluate` (a recipe's class_path), imported on first use: it imports Lightning."""
    if name == "Evaluate":
        from diffexp.evals.callback import Evaluate

        return Evaluate
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
