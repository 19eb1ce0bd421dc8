"""TensorBoard event files read as TensorBoard's EventAccumulator reads them, without its reader: `compare`
starts without importing tensorboard's event processing and its TensorFlow stub (a fifth of a second and more).

An events file is a sequence of TFRecords (a little-endian uint64 length, its masked CRC32-C, the serialized
`Event` proto, its masked CRC32-C), parsed with tensorboard's own `event_pb2`. What `scalar_events` keeps is what
`EventAccumulator(folder, size_guidance={SCALARS: 0, TENSORS: 0}).Reload()` keeps, in the same order:

- the folder's files whose name holds "tfevents" (not the ".profile-empty" ones), in sorted order, each to its
  end, or to its first truncated record or failed checksum (the writer may still be writing it);
- every summary value that is a simple_value (scalars), and every tensor (its tag, or node_name when it has none);
- purging as TensorBoard does for a restarted writer: with a file_version of 2 or more, a SessionLog.START event
  drops the scalars of every tag at its step or later; without, an event whose step is below the most recent
  step drops the scalars at or after its step of the tags it holds. Tensors are never purged.

tests/test_compare_events.py checks the values and their order against EventAccumulator's, restarts included.
"""

from __future__ import annotations

import struct
from pathlib import Path

_MASK = 0xFFFFFFFF


def _crc_table() -> tuple[int, ...]:
    """CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), one entry per byte value."""
    table = []
    for byte in range(256):
        crc = byte
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
        table.append(crc)
    return tuple(table)


_CRC_TABLE = _crc_table()


def masked_crc32c(data: bytes) -> int:
    """The masked CRC-32C of a TFRecord's length or data field."""
    crc, table = _MASK, _CRC_TABLE
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    crc ^= _MASK
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & _MASK


def records(path: Path):
    """The data of each whole, checksummed record of a TFRecord file, up to the first that is not."""
    data = Path(path).read_bytes()
    at = 0
    while at + 12 <= len(data):
        header = data[at:at + 8]
        (length,) = struct.unpack("<Q", header)
        if struct.unpack("<I", data[at + 8:at + 12])[0] != masked_crc32c(header):
            return
        start, end = at + 12, at + 12 + length
        if end + 4 > len(data):
            return
        record = data[start:end]
        if struct.unpack("<I", data[end:end + 4])[0] != masked_crc32c(record):
            return
        yield record
        at = end + 4


def event_files(folder: Path) -> list[Path]:
    """The events files EventAccumulator reads in `folder`, in its order."""
    paths = sorted(str(p) for p in Path(folder).iterdir()
                   if "tfevents" in p.name and not str(p).endswith(".profile-empty") and p.is_file())
    return [Path(p) for p in paths]


def _file_version(text: str) -> float:
    try:
        return float(text.split("brain.Event:")[-1])
    except ValueError:
        return -1


def _scalar_of(tensor):
    """A 0-d integer or floating tensor's value as TensorBoard's make_ndarray gives it; None for any other, and for
    one make_ndarray cannot read (no value or several, a dtype it does not know), where EventAccumulator's caller
    stopped with its error."""
    import numpy as np
    from tensorboard.compat.proto import types_pb2

    if len(tensor.tensor_shape.dim):
        return None
    kinds = {types_pb2.DT_FLOAT: (np.float32, "float_val"), types_pb2.DT_DOUBLE: (np.float64, "double_val"),
             types_pb2.DT_HALF: (np.float16, "half_val"), types_pb2.DT_INT32: (np.int32, "int_val"),
             types_pb2.DT_INT16: (np.int16, "int_val"), types_pb2.DT_INT8: (np.int8, "int_val"),
             types_pb2.DT_UINT8: (np.uint8, "int_val"), types_pb2.DT_UINT16: (np.uint16, "int_val"),
             types_pb2.DT_INT64: (np.int64, "int64_val")}
    if tensor.dtype not in kinds:
        return None
    dtype, field = kinds[tensor.dtype]
    if tensor.tensor_content:
        if len(tensor.tensor_content) != np.dtype(dtype).itemsize:
            return None
        return float(np.frombuffer(tensor.tensor_content, dtype=dtype)[0])
    values = getattr(tensor, field)
    if len(values) != 1:
        return None
    if dtype is np.float16:  # half_val holds the bits
        return float(np.array(values[0], dtype=np.uint16).view(np.float16))
    return float(np.array(values[0], dtype=dtype))


def scalar_events(folder: Path) -> dict[str, list[tuple[float, int, float]]]:
    """tag -> [(wall_time, step, value)] of the scalar summaries of the events files in `folder`: its simple
    values, then its 0-d numeric tensors, each in the order EventAccumulator keeps them (module doc)."""
    from tensorboard.compat.proto import event_pb2

    scalars: dict[str, list[tuple[float, int, float]]] = {}
    tensors: dict[str, list[tuple[float, int, float | None]]] = {}
    file_version, most_recent_step = None, -1
    for path in event_files(folder):
        for record in records(path):
            event = event_pb2.Event.FromString(record)
            if event.HasField("file_version"):
                file_version = _file_version(event.file_version)
            if file_version and file_version >= 2:
                if event.HasField("session_log") and event.session_log.status == event_pb2.SessionLog.START:
                    for tag in scalars:
                        scalars[tag] = [p for p in scalars[tag] if p[1] < event.step]
            elif event.step < most_recent_step and event.HasField("summary"):
                for value in event.summary.value:
                    if value.tag in scalars:
                        scalars[value.tag] = [p for p in scalars[value.tag] if p[1] < event.step]
            else:
                most_recent_step = event.step
            if event.WhichOneof("what") != "summary":
                continue
            for value in event.summary.value:
                kind = value.WhichOneof("value")
                if kind == "simple_value":
                    scalars.setdefault(value.tag, []).append((event.wall_time, event.step, float(value.simple_value)))
                elif kind == "tensor":
                    tensors.setdefault(value.tag or value.node_name, []).append(
                        (event.wall_time, event.step, _scalar_of(value.tensor)))
    found = {tag: points for tag, points in scalars.items()}
    for tag, points in tensors.items():
        kept = [point for point in points if point[2] is not None]
        if kept:
            found.setdefault(tag, []).extend(kept)
    return found
