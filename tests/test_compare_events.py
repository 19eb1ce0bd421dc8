"""`compare` reads TensorBoard events without tensorboard's reader (diffexp.sweep.events): what it keeps of a
folder is what TensorBoard's EventAccumulator keeps, value for value and in the same order, for event files as
Lightning writes them (a resumed run's second file, hparams, text, histograms, new-style tensor scalars) and for
the cases the accumulator handles on its own: a restarted writer (SessionLog.START, or out-of-order steps in a
file without a file_version), tensors in each encoding, a record still being written, a failed checksum.
"""

from __future__ import annotations

import struct

import numpy as np
import pytest
from tensorboard.compat.proto import event_pb2, summary_pb2, tensor_pb2, tensor_shape_pb2, types_pb2
from tensorboard.summary.writer.record_writer import RecordWriter

from diffexp.sweep.events import masked_crc32c, scalar_events
from diffexp.sweep.runs import load_curves
from tests.fixtures_compare import make_study, write_events


def accumulator_events(folder) -> dict[str, list[tuple[float, int, float]]]:
    """What load_curves kept of a folder before diffexp.sweep.events: EventAccumulator's scalars, then its 0-d
    numeric tensors, per tag."""
    from tensorboard.backend.event_processing.event_accumulator import (
        AUDIO,
        COMPRESSED_HISTOGRAMS,
        HISTOGRAMS,
        IMAGES,
        SCALARS,
        TENSORS,
        EventAccumulator,
    )
    from tensorboard.util import tensor_util

    sizes = {SCALARS: 0, TENSORS: 0, HISTOGRAMS: 1, IMAGES: 1, AUDIO: 1, COMPRESSED_HISTOGRAMS: 1}
    accumulator = EventAccumulator(str(folder), size_guidance=sizes)
    accumulator.Reload()
    raw: dict[str, list[tuple[float, int, float]]] = {}
    tags = accumulator.Tags()
    for tag in tags.get(SCALARS, []):
        raw.setdefault(tag, []).extend((e.wall_time, e.step, float(e.value)) for e in accumulator.Scalars(tag))
    for tag in tags.get(TENSORS, []):
        for e in accumulator.Tensors(tag):
            array = tensor_util.make_ndarray(e.tensor_proto)
            if array.ndim == 0 and array.dtype.kind in "fiu":
                raw.setdefault(tag, []).append((e.wall_time, e.step, float(array)))
    return raw


def old_load_curves(trial_dir) -> dict[str, list[tuple[int, float]]]:
    """load_curves as it was, through EventAccumulator."""
    folders = sorted({p.parent for p in trial_dir.rglob("events.out.tfevents*") if p.is_file()})
    raw: dict[str, list[tuple[float, int, float]]] = {}
    for folder in folders:
        for tag, points in accumulator_events(folder).items():
            raw.setdefault(tag, []).extend(points)
    curves = {}
    for tag, points in raw.items():
        by_step: dict[int, float] = {}
        for _, step, value in sorted(points, key=lambda p: p[0]):
            by_step[step] = value
        curves[tag] = sorted(by_step.items())
    return curves


def assert_same(folder) -> None:
    ours, theirs = scalar_events(folder), accumulator_events(folder)
    assert list(ours) == list(theirs)
    for tag in theirs:  # exact floats, in order
        assert ours[tag] == theirs[tag], tag


def event(step: int, wall_time: float | None = None, **what) -> event_pb2.Event:
    return event_pb2.Event(step=step, wall_time=1.0e9 + step if wall_time is None else wall_time, **what)


def scalar(tag: str, value: float) -> summary_pb2.Summary:
    return summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, simple_value=value)])


def tensor_summary(tag: str, tensor: tensor_pb2.TensorProto, node_name: str = "") -> summary_pb2.Summary:
    return summary_pb2.Summary(value=[summary_pb2.Summary.Value(tag=tag, node_name=node_name, tensor=tensor)])


def write_file(path, events: list[event_pb2.Event]) -> None:
    """A TFRecord file of `events`, written by tensorboard's own record writer (its checksums)."""
    with open(path, "wb") as handle:
        writer = RecordWriter(handle)
        for e in events:
            writer.write(e.SerializeToString())
        writer.flush()


def test_the_masked_crc_is_tensorboards():
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as theirs

    rng = np.random.default_rng(0)
    for size in (0, 1, 8, 13, 1000):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert masked_crc32c(data) == theirs(data)


def test_lightning_style_runs_read_as_tensorboard_reads_them(tmp_path):
    """SummaryWriter's files (torch's, as Lightning's TensorBoardLogger writes): two of them (a resume, which
    logs steps again), with hparams, text, a histogram and new-style scalars beside the plain ones."""
    from torch.utils.tensorboard import SummaryWriter

    for run, walltime in ((0, 1.0e9), (1, 2.0e9)):
        writer = SummaryWriter(log_dir=str(tmp_path), filename_suffix=f".{run}")
        try:
            for step in range(0, 300, 50):
                writer.add_scalar("train/loss", 3.0 - step / 97 + run, step + 100 * run, walltime=walltime + step)
                writer.add_scalar("val/new_style", 1.0 / (step + 1), step, walltime=walltime + step, new_style=True)
            writer.add_text("note", "resumed" if run else "fresh", 0)
            writer.add_histogram("weights", np.arange(10.0), 0)
            writer.add_hparams({"lr": 1e-3}, {"hp/val_loss": 2.5 - run}, run_name=".")
        finally:
            writer.close()
    assert_same(tmp_path)
    assert scalar_events(tmp_path)["val/new_style"] and scalar_events(tmp_path)["hp/val_loss"]


def test_a_restarted_writer_is_purged_as_tensorboard_purges_it(tmp_path):
    """file_version 2: a SessionLog.START drops every tag's scalars at its step or later (not the tensors);
    no file_version: a step below the latest drops the scalars at or after it, of the tags it holds only."""
    one = tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[0.5])
    versioned = tmp_path / "versioned"
    versioned.mkdir()
    write_file(versioned / "events.out.tfevents.1", [
        event(0, file_version="brain.Event:2"),
        *[event(s, summary=scalar("a", s / 10)) for s in range(0, 60, 10)],
        *[event(s, summary=tensor_summary("t", one)) for s in (20, 40)],
        event(30, session_log=event_pb2.SessionLog(status=event_pb2.SessionLog.START)),
        *[event(s, summary=scalar("a", -s / 10)) for s in range(30, 50, 10)]])
    unversioned = tmp_path / "unversioned"
    unversioned.mkdir()
    write_file(unversioned / "events.out.tfevents.1", [
        *[event(s, summary=scalar("a", s)) for s in range(0, 60, 10)],
        *[event(s, summary=scalar("b", s)) for s in range(60, 80, 10)],
        event(20, summary=scalar("a", -1.0)),  # out of order: purges a's steps >= 20, not b's
        event(90, summary=scalar("b", 9.0))])
    for folder in (versioned, unversioned):
        assert_same(folder)
    assert [p[1] for p in scalar_events(versioned)["a"]] == [0, 10, 20, 30, 40]
    assert [p[1] for p in scalar_events(unversioned)["a"]] == [0, 10, 20]
    assert [p[1] for p in scalar_events(unversioned)["b"]] == [60, 70, 90]


@pytest.mark.parametrize("tensor", [
    tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[0.3]),
    tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, tensor_content=struct.pack("<d", 0.1)),
    tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, tensor_content=struct.pack("<f", 2.5)),
    tensor_pb2.TensorProto(dtype=types_pb2.DT_HALF, half_val=[int(np.float16(1.5).view(np.uint16))]),
    tensor_pb2.TensorProto(dtype=types_pb2.DT_INT64, int64_val=[7]),
    tensor_pb2.TensorProto(dtype=types_pb2.DT_INT32, int_val=[-3]),
    tensor_pb2.TensorProto(dtype=types_pb2.DT_UINT8, int_val=[200]),
    tensor_pb2.TensorProto(dtype=types_pb2.DT_BOOL, bool_val=[True]),  # not a number: left out
    tensor_pb2.TensorProto(dtype=types_pb2.DT_STRING, string_val=[b"text"]),
    tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[1.0, 2.0],
                           tensor_shape=tensor_shape_pb2.TensorShapeProto(
                               dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=2)])),  # not 0-d: left out
], ids=["float_val", "double_content", "float_content", "half", "int64", "int32", "uint8", "bool", "string",
        "vector"])
def test_tensors_read_as_tensorboard_reads_them(tmp_path, tensor):
    write_file(tmp_path / "events.out.tfevents.1", [
        event(0, file_version="brain.Event:2"), event(5, summary=tensor_summary("x", tensor)),
        event(6, summary=tensor_summary("", tensor, node_name="old_style"))])
    assert_same(tmp_path)


@pytest.mark.parametrize("tensor", [
    tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE),
    tensor_pb2.TensorProto(dtype=types_pb2.DT_FLOAT, float_val=[1.0, 2.0]),
    tensor_pb2.TensorProto(dtype=types_pb2.DT_DOUBLE, tensor_content=struct.pack("<dd", 0.1, 0.2)),
    tensor_pb2.TensorProto(dtype=types_pb2.DT_UINT32, uint32_val=[3]),
], ids=["no_value", "two_values", "two_in_content", "uint32"])
def test_a_tensor_tensorboard_cannot_read_is_left_out(tmp_path, tensor):
    """Where make_ndarray raises (and compare stopped with its traceback), the value is left out."""
    write_file(tmp_path / "events.out.tfevents.1", [
        event(0, file_version="brain.Event:2"), event(4, summary=scalar("x", 1.0)),
        event(5, summary=tensor_summary("x", tensor))])
    with pytest.raises((ValueError, TypeError)):
        accumulator_events(tmp_path)
    assert scalar_events(tmp_path) == {"x": [(1.0e9 + 4, 4, 1.0)]}


def test_a_record_being_written_or_damaged_ends_the_file_as_in_tensorboard(tmp_path):
    """A truncated last record (the writer still at it) or a failed checksum of its length or its data: the
    file's events before it; the next file is read on."""
    events = [event(0, file_version="brain.Event:2"), *[event(s, summary=scalar("a", s)) for s in range(5)]]
    last = 12 + len(events[-1].SerializeToString()) + 4  # the last record: length, its crc, data, its crc

    def flip(at: int):
        return lambda b: b[:at] + bytes([b[at] ^ 1]) + b[at + 1:]

    for name, damage in (("truncated", lambda b: b[:-7]), ("length crc", flip(-last + 9)), ("data", flip(-6)),
                         ("data crc", flip(-2))):
        folder = tmp_path / name.replace(" ", "_")
        folder.mkdir()
        path = folder / "events.out.tfevents.1"
        write_file(path, events)
        path.write_bytes(damage(path.read_bytes()))
        write_file(folder / "events.out.tfevents.2", [event(9, summary=scalar("a", 9.0))])
        assert_same(folder)
        assert [p[1] for p in scalar_events(folder)["a"]] == [0, 1, 2, 3, 9], name


def test_load_curves_is_unchanged_on_a_study(tmp_path):
    study = make_study(tmp_path / "runs")
    write_events(tmp_path / "nested" / "version_0", {"val/loss": [(100, 2.0), (200, 1.5)]}, walltime=1.0e9)
    write_events(tmp_path / "nested", {"val/loss": [(200, 1.4), (300, 1.2)]}, walltime=2.0e9)
    trials = [p.parent for p in study.rglob("trial.json")] + [tmp_path / "nested"]
    assert len(trials) > 5
    for trial in trials:
        assert load_curves(trial) == old_load_curves(trial), trial
