"""Evaluations the papers use: needle retrieval, attention noise, MQAR, in-context learning, loss by position.

(The AR-Hit / Others split of the validation loss is logged by training: diffexp.training.loss_slices.)"""

#: what `diffexp eval harness` writes into a run's eval/ (evals/harness.py) and `diffexp compare` reads back: here,
#: where compare reads it without importing the evaluations (torch)
HARNESS_RESULTS_FILE = "harness.json"


def refuse_sharded_model(trainer, callback: str, command: str) -> None:
    """Evaluation callbacks call the model directly, outside Lightning's forward; FSDP keeps the weights sharded
    there. Stop at setup, before any training, and name the checkpoint command that does the same job."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    if isinstance(trainer.strategy, (FSDPStrategy, ModelParallelStrategy)):
        raise ValueError(f"{callback} cannot run under {type(trainer.strategy).__name__}: the weights are sharded "
                         f"outside the training forward. Remove it from trainer.callbacks and evaluate a "
                         f"checkpoint instead: {command}")
