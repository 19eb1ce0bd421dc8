"""Helpers shared by test modules: runs of the CLI and their logs, sweep specs, tiny models and checkpoints, the
Lightning callbacks that subprocess runs of the CLI load by class path (tests.helpers.<Name>), and every variant's
numerics cases with the checks that run them."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F

from tests.reference import CASES as FLAG_CASES
from tests.reference import reference_attention

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------- runs of `python -m diffexp`


# what an in-process fit on a distributed strategy leaves behind: later subprocess runs would inherit the port
DISTRIBUTED_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK", "RANK", "GROUP_RANK",
                   "LOCAL_WORLD_SIZE")


@contextlib.contextmanager
def no_process_group_left():
    """Around an in-process fit on a distributed strategy: afterwards no default process group, and the rank
    variables as they were before (a later subprocess run would inherit the port)."""
    saved = {key: os.environ.get(key) for key in DISTRIBUTED_ENV}
    try:
        yield
    finally:
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a `python -m diffexp` child: this checkout first on its path."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def one_thread_env(**extra: str) -> dict[str, str]:
    """subprocess_env for a child that shares the machine with others: one OpenMP thread."""
    return subprocess_env(OMP_NUM_THREADS="1", **extra)


def run_cli(args: list[str], cwd: Path, check=True) -> subprocess.CompletedProcess:
    """`python -m diffexp ARGS` in `cwd`; with check, a non-zero exit fails the test with the end of its stderr."""
    proc = subprocess.run([sys.executable, "-m", "diffexp", *args], cwd=cwd, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return proc


def stdout_of(args: list[str]) -> str:
    """What `diffexp ARGS`, run in this process, prints on stdout; it must exit 0."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert exit_code(args) == 0
    return out.getvalue()


def exit_code(args: list[str]) -> int:
    """The exit code of `diffexp ARGS` run in this process (diffexp.cli.main always exits)."""
    import pytest

    from diffexp.cli import main

    with pytest.raises(SystemExit) as done:
        main(args)
    return done.value.code


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ----------------------------------------------------------------------------- a tiny training recipe and its logs

TINY_RUN = """
seed_everything: 7
trainer:
  max_steps: {max_steps}
  val_check_interval: 6
  limit_val_batches: 2
  log_every_n_steps: 2
  enable_progress_bar: false
  enable_model_summary: false
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args: {{save_dir: runs, name: {name}, default_hp_metric: false}}
checkpoint:
  every_n_train_steps: 4
diagnostics:
  every_n_steps: 4
model:
  arch: {{attention: {attention}, d_model: 32, n_layers: 2, n_heads: 2}}
  optim: {{lr: 3.0e-3, warmup_steps: 2}}
data:
  source: stdlib
  seq_len: 32
  batch_size: 4
  max_chars: 60000
  cache_dir: {cache}
"""


def write_recipe(tmp_path: Path, name="run", attention="diff_v1", max_steps=12) -> Path:
    """TINY_RUN as <tmp_path>/<name>.yaml: logs to runs/<name>/, data cached under <tmp_path>/cache."""
    path = tmp_path / f"{name}.yaml"
    path.write_text(TINY_RUN.format(name=name, attention=attention, max_steps=max_steps,
                                    cache=tmp_path / "cache"))
    return path


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar a run logged to TensorBoard: tag -> [(step, value), ...]."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir)).Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


# ----------------------------------------------------------------------------- sweeps

TINY_OVERRIDES = {
    "trainer.max_steps": 6, "trainer.val_check_interval": 3, "trainer.limit_val_batches": 2,
    "model.arch.d_model": 32, "model.arch.n_layers": 1, "model.arch.n_heads": 2,
    "data.seq_len": 32, "data.batch_size": 4, "data.max_chars": 50000,
}


def write_spec(tmp_path: Path, study: str, storage: str | None = None, **extra) -> Path:
    """A sweep spec of two cases x two seeds of a tiny DIFF V1 (TINY_OVERRIDES) as <tmp_path>/<study>.yaml."""
    import yaml

    spec = {"study": study, "base": str(REPO / "recipes/tiny/diff_v1.yaml"), "runs_dir": str(tmp_path / "runs"),
            "overrides": {**TINY_OVERRIDES, "data.cache_dir": str(tmp_path / "cache")},
            "grid": {"model.arch.head_norm": [True, False]}, "seeds": [0, 1], **extra}
    if storage:
        spec["storage"] = storage
    path = tmp_path / f"{study}.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def trials_by_state(url: str, study: str) -> dict[str, Counter]:
    """Per sweep point, how many of its Optuna trials are in each state."""
    import optuna

    from diffexp.sweep.storage import open_storage

    trials = optuna.load_study(study_name=study, storage=open_storage(url)).get_trials(deepcopy=False)
    states: dict[str, Counter] = {}
    for t in trials:
        states.setdefault(t.user_attrs["point"], Counter())[t.state.name] += 1
    return states


# ----------------------------------------------------------------------------- a real full disk: a small tmpfs


@contextlib.contextmanager
def mounted_tmpfs(mount: Path, size: str):
    """A tmpfs of `size` (mount's `-o size=`: "64k", "64m") mounted at `mount` (created here), unmounted afterwards
    (lazily: a process the test started may still hold a file on it); skips the test where mounting is not
    permitted (root only)."""
    import pytest

    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip() or done.returncode}): needs root")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


# ----------------------------------------------------------------------------- weights and data

# runs on several CPU processes sum fp32 in another order: logged values agree to about 1e-6, weights after a few
# AdamW steps to 1e-5
RTOL, WEIGHTS_ATOL = 1e-4, 1e-5


def assert_same_weights(a: dict, b: dict, atol: float = WEIGHTS_ATOL) -> None:
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=atol, msg=key)


def callback(class_name: str, **init_args) -> str:
    """A fit argument adding the callback tests.helpers.<class_name>(**init_args)."""
    return "--trainer.callbacks+=" + json.dumps({"class_path": f"tests.helpers.{class_name}", "init_args": init_args})


def weights_at_end(name: str) -> str:
    """A fit argument saving the trained weights, whole, as <name>.pt in the fit's directory."""
    return callback("SaveFullWeights", path=f"{name}.pt")


def assert_bitwise_equal(a: Path, b: Path) -> None:
    """Two weight files (SaveFullWeights) hold the same tensors, bit for bit."""
    first, second = torch.load(a, weights_only=True), torch.load(b, weights_only=True)
    assert first.keys() == second.keys()
    for key in first:
        assert torch.equal(first[key], second[key]), key


def encode_documents(documents, tokenizer) -> np.ndarray:
    """The reference token stream: each document's ids, then the end-of-document id."""
    return np.array([i for text in documents for i in [*tokenizer.encode(text), tokenizer.eos_id]], dtype=np.int64)


# ----------------------------------------------------------------------------- callbacks loaded by class path


class RecordBatches(L.Callback):
    """Append (step, batch checksum, loss) per training batch to a JSON-lines file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        record = {"step": trainer.global_step - 1, "checksum": int((batch * torch.arange(batch.numel())
                  .view_as(batch)).sum()), "loss": float(outputs["loss"])}
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")


class KillAtStep(L.Callback):
    """Die like a killed process (no cleanup, no exception handling) once `step` steps are done."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step:
            os._exit(137)


class KillAtFitEnd(L.Callback):
    """Die after the final checkpoint is written but before later callbacks' on_fit_end; keep val/loss."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_fit_end(self, trainer, pl_module) -> None:
        with open(self.path, "w") as f:
            json.dump({"val/loss": float(trainer.callback_metrics["val/loss"]), "step": trainer.global_step}, f)
        os._exit(137)


class InjectNonFinite(L.Callback):
    """At step `step`, make `quantity` non-finite without touching the weights, after saving them to
    `weights_path`: "train/loss" becomes inf, or one gradient entry ("vitals/grad_norm") becomes NaN. With `rank`,
    the loss of that rank only."""

    def __init__(self, step: int, quantity: str, weights_path: str, rank: int | None = None) -> None:
        self.step, self.quantity, self.weights_path, self.rank = step, quantity, weights_path, rank

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step != self.step:
            return
        if self.rank is None:  # the full weights (every rank saves the same file; a sharded run: see rank)
            torch.save({k: v.detach().clone() for k, v in pl_module.state_dict().items()}, self.weights_path)
        if self.quantity == "train/loss" and self.rank in (None, trainer.global_rank):
            loss = pl_module._loss
            pl_module._loss = lambda batch: loss(batch) + float("inf")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if trainer.global_step == self.step and self.quantity == "vitals/grad_norm":
            grad = next(p.grad for p in pl_module.parameters() if p.grad is not None)
            grad.view(-1)[0] = float("nan")


class KillAfterCheckpoint(L.Callback):
    """SIGKILL this process right after the checkpoint file `name` of step `step` is in place."""

    def __init__(self, step: int, name: str = "last.ckpt") -> None:
        self.step, self.name = step, name

    def setup(self, trainer, pl_module, stage) -> None:
        io, save = trainer.strategy.checkpoint_io, trainer.strategy.checkpoint_io.save_checkpoint

        def save_then_die(checkpoint, path, storage_options=None):
            save(checkpoint, path, storage_options)
            if os.path.basename(path) == self.name and checkpoint["global_step"] == self.step:
                os.kill(os.getpid(), signal.SIGKILL)

        io.save_checkpoint = save_then_die


class SaveWeightsAtStart(L.Callback):
    """Save the model's weights as training starts (after setup, before the first step) to `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_start(self, trainer, pl_module) -> None:
        torch.save({k: v.detach().cpu().clone() for k, v in pl_module.state_dict().items()}, self.path)


class SaveFullWeights(L.Callback):
    """At the end of training, the model's full weights (gathered from the shards under FSDP2) to `path`."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_end(self, trainer, pl_module) -> None:
        from diffexp.parallel import full_value

        weights = {k: full_value(v).detach().cpu().clone() for k, v in pl_module.model.state_dict().items()}
        if trainer.is_global_zero:
            torch.save(weights, self.path)


class SignalAtStep(L.Callback):
    """Send `signum` (a name: SIGTERM, SIGINT, SIGUSR1) to this process while step `step` runs (before its optimizer
    step), or with `during="validation"` while the validation after `step` steps runs; on rank `rank` only if given:
    a scheduler's signal arriving mid-step."""

    def __init__(self, step: int, signum: str = "SIGTERM", rank: int | None = None, during: str = "train") -> None:
        self.step, self.signum, self.rank, self.during = step, getattr(signal, signum), rank, during

    def _send(self, trainer, during: str) -> None:
        if during == self.during and trainer.global_step == self.step and self.rank in (None, trainer.global_rank):
            os.kill(os.getpid(), self.signum)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._send(trainer, "train")

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        if not trainer.sanity_checking:
            self._send(trainer, "validation")


class SignalAtSetup(L.Callback):
    """Send SIGTERM to this process at the fit's setup, before anything is trained or saved: a job stopped during
    its data preparation or start-up."""

    def setup(self, trainer, pl_module, stage) -> None:
        os.kill(os.getpid(), signal.SIGTERM)


class HoldFirstAttempt(L.Callback):
    """Wait at the fit's setup (nothing trained or saved yet) on a SLURM job's first attempt, until a signal stops
    it: a job preempted during its data preparation or start-up. A requeued attempt (SLURM_RESTART_COUNT >= 1)
    goes on."""

    def setup(self, trainer, pl_module, stage) -> None:
        if int(os.environ.get("SLURM_RESTART_COUNT") or 0) == 0:
            time.sleep(600)


class SignalDuringSave(L.Callback):
    """Send SIGTERM to this process while the checkpoint file of step `step` is being written (inside the save)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def setup(self, trainer, pl_module, stage) -> None:
        io, save = trainer.strategy.checkpoint_io, trainer.strategy.checkpoint_io.save_checkpoint

        def signal_then_save(checkpoint, path, storage_options=None):
            if checkpoint["global_step"] == self.step:
                os.kill(os.getpid(), signal.SIGTERM)
            save(checkpoint, path, storage_options)

        io.save_checkpoint = signal_then_save


class KillRankZeroAtStep(L.Callback):
    """SIGKILL the launching process (rank 0) once `step` steps are done; the other ranks lose their peer."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step >= self.step and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGKILL)


class RecordStepLosses(L.Callback):
    """Append {"step", "loss"} per optimizer step to a JSON-lines file (rank 0): the loss over the whole global
    batch, the mean of its micro-batches' losses (each already the mean over ranks), whatever the accumulation;
    Lightning's logged train/loss is the step's last micro-batch's."""

    def __init__(self, path: str) -> None:
        self.path, self.losses = path, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(pl_module.last_train_loss))
        if len(self.losses) < trainer.accumulate_grad_batches:  # the step is not done yet
            return
        if trainer.is_global_zero:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": trainer.global_step - 1, "loss": sum(self.losses) / len(self.losses)})
                        + "\n")
        self.losses = []


# ----------------------------------------------------------------------------- tiny models and checkpoints

#: the sentence the `memorised` fixture's model learned (tests/conftest.py)
PATTERN = "the cat sat on the mat. "


def small_model(attention: str = "diff_v2", vocab_size: int = 257, max_seq_len: int = 64):
    """A DiffexpLM of d_model 32, 2 layers, seeded: the same weights on every call."""
    from diffexp.model.config import ModelConfig
    from diffexp.training import DiffexpLM

    torch.manual_seed(0)
    return DiffexpLM(ModelConfig(attention=attention, vocab_size=vocab_size, d_model=32, n_layers=2, n_heads=2,
                                 max_seq_len=max_seq_len))


def save_checkpoint(module, path, datamodule=None):
    """A checkpoint as a Trainer writes it; with a data module, after one real training step on it (so the
    checkpoint holds the data module's settings and its tokenizer)."""
    trainer = L.Trainer(max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    if datamodule is None:
        trainer.strategy.connect(module)
    else:
        trainer.fit(module, datamodule=datamodule)
    trainer.save_checkpoint(path)
    return path


def save_untrained_checkpoint(arch, path) -> None:
    """A real diffexp checkpoint of an untrained model (a Trainer's save, no training), for checkpoint readers."""
    from diffexp.training import DiffexpLM

    module = DiffexpLM(arch)
    trainer = L.Trainer(max_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(path)


def bpe_text_checkpoint(directory, max_seq_len: int = 256):
    """(checkpoint path, data module): a small model trained one step on a 300-token BPE of 100K characters of
    the stdlib corpus (two fifths of its documents held out for validation), saved as
    <directory>/run/checkpoints/last.ckpt with its tokenizer and data settings."""
    from diffexp.data import TextDataModule

    data = TextDataModule(tokenizer="bpe", bpe_vocab_size=300, seq_len=32, batch_size=4, max_chars=100_000,
                          val_fraction=0.4, cache_dir=str(directory / "cache"))  # a few validation documents
    model = small_model(vocab_size=data.tokenizer.vocab_size, max_seq_len=max_seq_len)
    return save_checkpoint(model, directory / "run" / "checkpoints" / "last.ckpt", data), data


def require_cpu_kernel() -> None:
    """Skip where no C++ compiler exists (the PyTorch-ops fallback runs there); elsewhere the compiled CPU attention
    kernel must build, so a broken build fails the tests instead of silently falling back."""
    import shutil

    import pytest

    from diffexp.kernels import cpu_native

    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the compiled CPU attention kernel cannot be built here")
    reason = cpu_native.unavailable_reason()
    assert reason is None, f"the CPU attention kernel did not build: {reason}"


# ----------------------------------------------------------------------------- every variant's numerics cases

#: the size of the models the attention cases build
SMALL = dict(vocab_size=61, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, max_seq_len=64)


def variant_cases() -> dict[str, dict]:
    """Every registered variant and every value of each of its flags, from tests/reference.py's cases
    (GQA and plain MHA layouts both appear): "diff_v1", "diff_v1-mha", ..."""
    from diffexp.model.attention import variants

    return {"-".join(filter(None, (v.name, suffix))): dict(overrides)
            for v in variants() for suffix, overrides in FLAG_CASES[v.name].items()}


#: the cases of the variants registered at import, for parametrize (tests/test_attention.py, test_kv_cache.py)
CASES = variant_cases()


def make_config(case: str, **extra):
    """The SMALL ModelConfig of a case of variant_cases(), with `extra` on top."""
    from diffexp.model.attention import variants
    from diffexp.model.config import ModelConfig

    cases = variant_cases()  # also variants registered after collection (tests/test_variant_registry.py)
    name = next(v.name for v in variants() if case == v.name or case.startswith(v.name + "-"))
    return ModelConfig(attention=name, **{**SMALL, **cases[case], **extra})


def small_blocks(model: torch.nn.Module) -> None:
    """Force DINT's streaming integral over several query blocks even at test lengths."""
    from diffexp.model.attention.dint import DintAttention

    for module in model.modules():
        if isinstance(module, DintAttention):
            module.integral_block_size = 5


def with_backend(model, backend: str):
    """A copy of the Decoder `model` whose attention runs on `backend`."""
    twin = copy.deepcopy(model)
    for block in twin.blocks:
        block.attn.backend = backend
    return twin


def check_matches_naive_reference(case: str, backend: str) -> None:
    """A case's attention module (fast and eager paths) against its naive float64 reference of tests/reference.py."""
    from diffexp.model.attention import build_attention

    cfg = make_config(case, backend=backend)
    attn = build_attention(cfg, layer_idx=2).double()  # layer 2: lambda_init 0.471 under "depth"
    small_blocks(attn)
    x = torch.randn(2, 13, cfg.d_model, dtype=torch.float64)
    with torch.no_grad():
        out, _ = attn(x)
        out_eager, maps = attn(x, need_weights=True)
        ref_out, ref_maps = reference_attention(attn, x)
    torch.testing.assert_close(out, ref_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(out_eager, ref_out, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(maps.double(), ref_maps, rtol=1e-6, atol=1e-6)  # maps are fp32


def check_gradients_match_naive_reference(case: str, backend: str) -> None:
    """Every gradient of a case's attention module (the input's and each parameter's) against its float64
    reference's, at 1e-9: the same weights, one upstream gradient."""
    from diffexp.model.attention import build_attention

    cfg = make_config(case, backend=backend)
    attn = build_attention(cfg, layer_idx=2).double()
    small_blocks(attn)
    twin = copy.deepcopy(attn)
    x = torch.randn(2, 13, cfg.d_model, dtype=torch.float64)
    upstream = torch.randn(2, 13, cfg.d_model, dtype=torch.float64)
    x_in, x_ref = x.clone().requires_grad_(), x.clone().requires_grad_()
    attn(x_in)[0].backward(upstream)
    reference_attention(twin, x_ref)[0].backward(upstream)
    torch.testing.assert_close(x_in.grad, x_ref.grad, rtol=1e-9, atol=1e-9)
    for (name, got), (_, wanted) in zip(attn.named_parameters(), twin.named_parameters(), strict=True):
        assert wanted.grad is not None, f"the reference does not read {name}"
        torch.testing.assert_close(got.grad, wanted.grad, rtol=1e-9, atol=1e-9, msg=lambda m, n=name: f"d{n}: {m}")


def check_fast_path_equals_eager(case: str) -> None:
    """A case's Decoder on sdpa and on eager: the same logits and the same gradient for every parameter."""
    from diffexp.model import Decoder

    model = Decoder(make_config(case, backend="sdpa"))
    small_blocks(model)
    eager = with_backend(model, "eager")
    idx = torch.randint(0, 61, (2, 24))
    target = torch.randint(0, 61, (2, 24))
    losses = []
    for m in (model, eager):
        logits = m(idx)
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        loss.backward()
        losses.append((logits, loss))
    torch.testing.assert_close(losses[0][0], losses[1][0], rtol=1e-5, atol=1e-5)
    for (name, p_fast), (_, p_eager) in zip(model.named_parameters(), eager.named_parameters()):
        assert p_fast.grad is not None, name
        torch.testing.assert_close(p_fast.grad, p_eager.grad, rtol=1e-4, atol=1e-6, msg=name)


def check_causality(case: str, backend: str) -> None:
    """Changing the tokens after position t changes neither the outputs nor the maps up to t."""
    from diffexp.model import Decoder

    model = Decoder(make_config(case, backend=backend)).eval()
    small_blocks(model)
    idx = torch.randint(0, 61, (2, 20))
    t = 11
    changed = idx.clone()
    changed[:, t + 1:] = torch.randint(0, 61, changed[:, t + 1:].shape)
    assert not torch.equal(changed, idx)
    with torch.no_grad():
        before, maps_before = model(idx, need_weights=True)
        after, maps_after = model(changed, need_weights=True)
        fast_before, fast_after = model(idx), model(changed)
    torch.testing.assert_close(before[:, : t + 1], after[:, : t + 1], rtol=0, atol=1e-6)
    torch.testing.assert_close(fast_before[:, : t + 1], fast_after[:, : t + 1], rtol=0, atol=1e-6)
    assert not torch.allclose(before[:, t + 1:], after[:, t + 1:])
    for m_before, m_after in zip(maps_before, maps_after):
        assert torch.all(m_before.triu(1) == 0), "weight on a future token"
        torch.testing.assert_close(m_before[:, :, : t + 1], m_after[:, :, : t + 1], rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------- eval harness

def naive_logprob(model, ids: list[int], start: int) -> float:
    """log p(ids[start:] | ids[:start]) from one full forward, no batching or padding."""
    with torch.no_grad():
        logits = model(torch.tensor([ids[:-1]]))[0].double().log_softmax(-1)
    return float(sum(logits[t - 1, ids[t]] for t in range(start, len(ids))))


LOCAL_TASK = """task: diffexp_toy
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
DOCS = [{"question": "the cat sat on the", "choices": ["mat.", "hat.", "dog."], "answer": 0},
        {"question": "the cat sat", "choices": ["in", "on", "at"], "answer": 1},
        {"question": "on the mat. the", "choices": ["dog", "cat", "mat"], "answer": 1},
        {"question": "the mat", "choices": ["sat", "."], "answer": 0}]


def write_local_task(root: Path, data_name: str = "toy.jsonl", write_data: bool = True) -> Path:
    tasks = root / "tasks"
    tasks.mkdir(parents=True, exist_ok=True)
    data = root / data_name
    if write_data:
        data.write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tasks / "toy.yaml").write_text(LOCAL_TASK.format(data=data))
    return tasks


# ----------------------------------------------------------------------------- exported models (test_export_hf*)

#: a prompt with characters of two bytes, so a decoder that splits them shows
PROMPT = "héllo wörld"
#: the byte tokenizer's state, as a checkpoint carries it
BYTE = {"kind": "byte"}


def tiny_decoder(case: str, **extra):
    """The case's model (vocab 257: bytes and end of document) with every norm, lambda, gamma and learned sink moved
    off its init, so a head norm weight that is not folded or a lambda read in the wrong place shows in the logits."""
    from diffexp.model.decoder import Decoder

    torch.manual_seed(0)
    model = Decoder(make_config(case, vocab_size=257, **extra)).eval()
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name or "lambda_" in name or name.endswith(("gamma", "sinks")):
                param.add_(0.3 * torch.randn(param.shape, generator=generator))
    return model


def write_checkpoint(model, path, tokenizer: dict | None = BYTE):
    """A diffexp checkpoint of `model` as read_checkpoint reads it (DiffexpLM's names: model.<Decoder's>)."""
    from dataclasses import asdict

    checkpoint = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()},
                  "hyper_parameters": {"arch": asdict(model.cfg)}, "global_step": 0}
    if tokenizer is not None:
        checkpoint["diffexp_tokenizer"] = tokenizer
    torch.save(checkpoint, path)
    return path


# ----------------------------------------------------------------------------- Markdown as a renderer reads it


def markdown_tables(text: str) -> list[list[list[str]]]:
    """Every table a Markdown renderer (markdown-it-py, CommonMark with GFM tables) draws from `text`, as rows of
    cell texts, the header row first. Asserts that each line that starts with "|" belongs to a drawn table (a
    header with another number of cells than its delimiter row is drawn as a paragraph) and that each row of a
    table has its header's number of cells."""
    from markdown_it import MarkdownIt

    tokens = MarkdownIt("commonmark").enable("table").parse(text)
    lines = text.splitlines()
    tables, covered, row, cells = [], set(), None, 0
    for token in tokens:
        if token.type == "table_open":
            tables.append([])
            covered.update(range(*token.map))
        elif token.type == "tr_open":
            row = []
            cells = sum(1 for _ in _unescaped_pipes(lines[token.map[0]])) - 1  # the row's own line, "| a | b |"
        elif token.type == "inline" and row is not None:
            row.append(token.content)
        elif token.type == "tr_close":
            tables[-1].append(row)
            header = tables[-1][0]
            assert len(row) == len(header) == cells, f"a row of {cells} cells under a header of {len(header)}: {row}"
            row = None
    stray = [line for i, line in enumerate(lines) if line.startswith("|") and i not in covered]
    assert not stray, f"lines no renderer draws as a table: {stray}"
    return tables


def _unescaped_pipes(line: str):
    escaped = False
    for char in line:
        if char == "|" and not escaped:
            yield char
        escaped = char == "\\" and not escaped


def tiny_fit_args(tmp_path) -> list[str]:
    """`diffexp fit` arguments of a one-layer model on the embedded corpus, its cache under tmp_path."""
    return ["--model.arch.d_model", "32", "--model.arch.n_layers", "1", "--model.arch.n_heads", "2",
            "--data.seq_len", "32", "--data.max_chars", "40000", "--data.cache_dir", str(tmp_path / "cache")]


# ----------------------------------------------------------------------------- FSDP2 on CPU processes

FSDP_STEPS = 8
FSDP_RECIPE = """
seed_everything: 7
trainer:
  accelerator: cpu
  devices: {devices}
  max_steps: {steps}
  val_check_interval: 4
  limit_val_batches: 2
  log_every_n_steps: 1
  enable_progress_bar: false
  strategy: {strategy}
  logger:
    class_path: lightning.pytorch.loggers.TensorBoardLogger
    init_args: {{save_dir: runs, name: {name}, default_hp_metric: false}}
  callbacks:
    - class_path: tests.helpers.SaveFullWeights
      init_args: {{path: {name}.pt}}
checkpoint:
  every_n_train_steps: 4
diagnostics:
  every_n_steps: 4
throughput:
  window_size: 2
model:
  arch: {{attention: diff_v1, d_model: 32, n_layers: 2, n_heads: 2, max_seq_len: 32}}
  optim: {{lr: 3.0e-3, warmup_steps: 2}}
data:
  source: stdlib
  seq_len: 32
  batch_size: {batch}
  max_chars: 60000
  cache_dir: cache
"""
FSDP2 = "{class_path: diffexp.parallel.FSDP2Strategy, init_args: {replicate_across_nodes: %s}}"


def write_fsdp_recipe(root: Path, name: str, devices: int, batch: int, strategy: str, steps: int = FSDP_STEPS) -> Path:
    path = root / f"{name}.yaml"
    path.write_text(FSDP_RECIPE.format(name=name, devices=devices, batch=batch, strategy=strategy, steps=steps))
    return path


def added_on_purpose(model) -> int:
    """Parameters a variant adds to the size's shape by design and reports instead of matching (diffexp params):
    the gated variant's gate projection, d_model x h d per layer (x h headwise)."""
    return sum(p.numel() for name, p in model.named_parameters() if ".attn.gate_proj." in name)


# ----------------------------------------------------------------------------- a one-node SLURM cluster

SLURM_UP = REPO / ".ci" / "slurm-up"
SLURM_TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo")


class Slurm:
    """The one-node cluster .ci/slurm-up runs (started by CI or by the first test that needs it): its config, the
    environment its commands and jobs need, and submission and waiting by job id through the real client tools."""

    def __init__(self, conf: Path) -> None:
        self.conf = conf

    def env(self, **extra: str) -> dict[str, str]:
        """one_thread_env with SLURM_CONF and this interpreter's bin first on PATH (`diffexp`, `python`): what
        `sbatch` needs, and, exported to the job (sbatch's default --export=ALL), what its tasks run with."""
        env = one_thread_env()
        path = os.pathsep.join(p for p in (str(Path(sys.executable).parent), env.get("PATH", "")) if p)
        return {**env, "PATH": path, "SLURM_CONF": str(self.conf), **extra}

    def run(self, *args: str, cwd: Path | None = None, check: bool = True, env: dict | None = None) -> str:
        proc = subprocess.run(list(args), cwd=cwd, env=self.env(**(env or {})), capture_output=True, text=True,
                              timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
        return proc.stdout

    def sbatch(self, script: Path, *options: str, args: tuple[str, ...] = (), env: dict | None = None) -> str:
        """`sbatch OPTIONS SCRIPT ARGS` from the script's directory, `env` added to what the job inherits; the
        job id ("123", an array's "123")."""
        return self.run("sbatch", "--parsable", *options, str(script.name), *args, cwd=script.parent,
                        env=env).strip().split(";")[0]

    def jobs(self, job: str) -> list[dict[str, str]]:
        """`scontrol show job --details` of a job (every task of an array), one dict of its fields per job (with
        the CPU_IDs of a running one); finished jobs stay listed for MinJobAge (300 s)."""
        out = self.run("scontrol", "show", "job", "--details", "--oneliner", job, check=False)
        return [dict(field.split("=", 1) for field in line.split() if "=" in field) for line in out.splitlines()
                if line.strip()]

    def wait(self, job: str, until=None, timeout: float = 600) -> list[dict[str, str]]:
        """Poll until `until(jobs)` holds (default: every task of the job has ended); the jobs' last fields."""
        import time

        done = until or (lambda jobs: jobs and all(j["JobState"] in SLURM_ENDED for j in jobs))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            jobs = self.jobs(job)
            if done(jobs):
                return jobs
            stuck = [j for j in jobs if j["JobState"] == "PENDING" and j.get("Reason") in SLURM_NEVER]
            if stuck:
                raise AssertionError(f"job {job} can never start here: {stuck[0]['Reason']} ({self.conf})")
            time.sleep(0.5)
        raise AssertionError(f"job {job} still {[j.get('JobState') for j in self.jobs(job)]} after {timeout} s")

    def release(self, job: str) -> None:
        """A requeued job waits about two minutes (its BeginTime) before it may start again; let it start now, as
        an administrator would with `scontrol update`."""
        self.run("scontrol", "update", f"JobId={job}", "StartTime=now")


#: why a pending job waits for a cluster other than this one (more CPUs, other partitions): waiting would never end
SLURM_NEVER = {"PartitionConfig", "BadConstraints", "PartitionNodeLimit", "PartitionTimeLimit"}
SLURM_ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "PREEMPTED", "OUT_OF_MEMORY",
               "BOOT_FAIL", "DEADLINE"}


def slurm_cluster(directory: Path) -> Slurm | str:
    """The cluster .ci/slurm-up starts from `directory` (reused where it answers; a lock keeps two pytest-xdist
    workers from both starting one), or why there is none: the reason to skip with."""
    import shutil

    missing = [tool for tool in SLURM_TOOLS if shutil.which(tool) is None]
    if missing:
        return f"slurm-wlm is not installed ({', '.join(missing)} not found): apt-get install -y slurm-wlm"
    if os.geteuid() != 0:
        return "the one-node SLURM cluster runs slurmd as root (it starts jobs as their user); these tests run as root"
    proc = subprocess.run(["bash", str(SLURM_UP), str(directory)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise AssertionError(f".ci/slurm-up {directory} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return Slurm(directory / "slurm.conf")


# ----------------------------------------------------------------------------- diffexp eval

#: three short documents: held-out text for `diffexp eval ... --text-file`
EVAL_TEXTS = {"a.txt": "the first document is long enough to read", "b.txt": "a second document, also long enough",
              "c.txt": "and a third one holds even more text"}


def run_eval(args, capsys) -> tuple[int, str]:
    """`diffexp eval ARGS` in this process: (exit code, stdout and stderr)."""
    import pytest

    from diffexp.cli import main

    with pytest.raises(SystemExit) as done:
        main(["eval", *args])
    captured = capsys.readouterr()
    return done.value.code, captured.out + captured.err


def write_texts(tmp_path) -> list[str]:
    """EVAL_TEXTS as files in tmp_path; their paths."""
    for name, text in EVAL_TEXTS.items():
        (tmp_path / name).write_text(text)
    return [str(tmp_path / name) for name in EVAL_TEXTS]
