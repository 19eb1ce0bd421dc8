"""The decoding step replayed as a CUDA graph: one token's step launches hundreds of small kernels, and a graph
launches them all at once (torch.cuda.CUDAGraph, as the PyTorch docs' whole-network capture does).

A graph replays the kernels it recorded on the memory it recorded. So the step's inputs (the token ids) are copied
into buffers of the graph's own, and every other tensor the step reads or writes must stay where it was:
- the caller names an `epoch` that changes whenever its own tensors may have moved (the decoder: the cache and its
  allocations), and a new epoch means a new capture, at which the compiled step's guards are checked again;
- the `watched` tensors (the weights) are checked at every call, by address, since a weight can be given new
  storage (`.data = ...`, `.to(...)`) between two steps.
Values written in place (weights loaded, the cache filled) are read as they are at each replay. A replay runs no
Python, so each step costs one address per weight, the input's copy and the replay.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from diffexp.kernels.registry import register_step_replay

Run = Callable[[], torch.Tensor]
_data_ptr = torch.Tensor.data_ptr


def cuda_warm_up(run: Run, times: int) -> None:
    """Run the step on a side stream first, as capture requires (it compiles, and allocates its workspaces)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(times):
            run()
    torch.cuda.current_stream().wait_stream(stream)


def cuda_record(run: Run) -> tuple[Callable[[], None], torch.Tensor]:
    """Capture run() into a CUDA graph (nothing executes): the replay, and the output each replay rewrites."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = run()
    return graph.replay, output


class GraphReplay:
    """replay(step, inputs, epoch, watched, restored) computes step(*inputs) by replaying a graph captured at the
    first call, and again whenever `epoch` changed or a watched tensor moved.

    inputs: copied into the graph's own buffers at each call; epoch: any value, equal while every tensor the step
    reads besides the inputs and the watched ones stays where it is; watched(): the tensors whose addresses are
    checked at each call; restored(): the tensors the step updates by accumulating (DINT's running sums), put back
    after the warm-up so the replay adds once. Writes the replay repeats with the same values (the new token's keys
    at its position) need no restoring. watched and restored are asked at a capture only. record and warm_up:
    CUDA's by default. Where a capture fails, a warning says why and every later call runs the step without a
    graph.
    """

    def __init__(self, record: Callable[[Run], tuple[Callable[[], None], torch.Tensor]] = cuda_record,
                 warm_up: Callable[[Run, int], None] = cuda_warm_up, warm_ups: int = 2) -> None:
        self.record, self.warm_up, self.warm_ups = record, warm_up, warm_ups
        self.captures = 0  # how many graphs were captured (tests check it)
        self.failed: str | None = None  # why a capture failed
        self._key: tuple | None = None
        self._watched: list[torch.Tensor] = []
        self._addresses: tuple[int, ...] = ()
        self._inputs: list[torch.Tensor] = []
        self._replay: Callable[[], None] | None = None
        self._output: torch.Tensor | None = None

    def __call__(self, step: Callable[..., torch.Tensor], inputs: Sequence[torch.Tensor], epoch: object,
                 watched: Callable[[], Sequence[torch.Tensor]],
                 restored: Callable[[], Sequence[torch.Tensor]]) -> torch.Tensor:
        if self.failed is not None:
            return step(*inputs)
        key = (epoch, tuple((t.shape, t.dtype, t.device) for t in inputs))
        if key != self._key or tuple(map(_data_ptr, self._watched)) != self._addresses:
            self._capture(step, inputs, restored())
            if self.failed is not None:
                return step(*inputs)
            self._key, self._watched = key, list(watched())
            self._addresses = tuple(map(_data_ptr, self._watched))
        for mine, given in zip(self._inputs, inputs, strict=True):
            mine.copy_(given)
        self._replay()
        return self._output.clone()  # the next replay rewrites the graph's output memory

    def _capture(self, step, inputs, restored: Sequence[torch.Tensor]) -> None:
        self._replay = self._output = None  # the old graph and its memory pool go first
        self._key, self._watched = None, []
        self._inputs = [tensor.clone() for tensor in inputs]

        def run() -> torch.Tensor:
            return step(*self._inputs)

        saved = [tensor.clone() for tensor in restored]
        self.warm_up(run, self.warm_ups)
        try:
            self._replay, self._output = self.record(run)
            self.captures += 1
        except Exception as err:  # noqa: BLE001 - the step still runs, only slower
            self.failed = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
            warnings.warn(f"the decoding step could not be captured as a CUDA graph ({self.failed}); decoding "
                          "through the compiled step without one", stacklevel=3)
        finally:
            for tensor, before in zip(restored, saved, strict=True):
                with torch.inference_mode(tensor.is_inference()):  # a cache filled under inference_mode
                    tensor.copy_(before)


register_step_replay("cuda", GraphReplay)
