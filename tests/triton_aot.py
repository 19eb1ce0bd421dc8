"""Compiles every Triton kernel diffexp ships for an H100 (sm_90) on a machine without a GPU, as its launches ask.

    python -m tests.triton_aot DTYPE D DV H_KV    (from the repository root; prints one JSON object)

Triton compiles ahead of time for a target down to the cubin (its wheel brings ptxas). The active driver is
replaced by one that names sm_90, and each launch compiles instead of running (`warmup`), so every kernel is
built from exactly the arguments, constexprs and options that diffexp's own call gives it: the default tiles
(`triton_dint.tiles`), Triton's default warps and stages, and its specialisation of the integers and pointers. The
call is DINT's integral at (B, h, T) = (1, 2, 2048), forward and backward, on CPU tensors the kernels never read.
It runs in a process of its own: the test session runs the same kernels through the interpreter.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import sys
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # read as triton is imported: compiled kernels, not interpreted ones

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

import diffexp  # noqa: E402

H100 = GPUTarget("cuda", 90, 32)
RECORDED = ("KEYS", "BLOCK_M", "BLOCK_N", "BLOCK_D", "BLOCK_DV", "num_warps", "num_stages")


class _H100:
    """The driver calls a launch makes before it compiles."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return H100


def shipped_kernels() -> list[str]:
    """Every @triton.jit function in diffexp that no other one calls (a kernel, not a helper), as module.name."""
    package = Path(diffexp.__file__).parent
    found = {}
    for path in sorted(package.rglob("*.py")):
        if "triton.jit" in path.read_text():
            name = ".".join(path.relative_to(package.parent).with_suffix("").parts)
            module = importlib.import_module(name)
            found.update({f"{name}.{key}": value for key, value in vars(module).items()
                          if isinstance(value, JITFunction) and value.__module__ == name})
    called = {name for name, fn in found.items() for other in found.values()
              if other is not fn and re.search(rf"\b{fn.__name__}\(", other.src)}
    return sorted(set(found) - called)


def build(dtype: torch.dtype, d: int, dv: int, hk: int) -> dict:
    builds = []
    launch = JITFunction.run

    def compile_only(self, *args, grid, warmup, **kwargs):
        kernel = launch(self, *args, grid=grid, warmup=True, **kwargs)
        meta = kernel.metadata
        builds.append(dict(kernel=f"{self.__module__}.{self.__name__}",
                           **{key: kwargs[key] for key in RECORDED if key in kwargs},
                           num_warps=meta.num_warps, num_stages=meta.num_stages, shared=meta.shared,
                           ttir=kernel.asm["ttir"]))
        return kernel

    from diffexp.kernels.triton_dint import _Integral, tiles

    b, h, t = 1, 2, 2048
    q, k, v = (torch.randn(b, heads, t, width, dtype=dtype).requires_grad_()
               for heads, width in ((h, d), (hk, d), (hk, dv)))
    lse = torch.zeros(b, h, t)
    driver.set_active(_H100())  # for the rest of this process, which does nothing else
    JITFunction.run = compile_only
    out = _Integral.apply(q, k, v, lse, d**-0.5, *tiles(d, dv))  # what dint_integral calls on a GPU
    out.backward(torch.ones_like(out))
    return dict(triton=triton.__version__, tiles=tiles(d, dv), kernels=shipped_kernels(), builds=builds)


if __name__ == "__main__":
    dtype_name, d, dv, hk = sys.argv[1:]
    print(json.dumps(build(getattr(torch, dtype_name), int(d), int(dv), int(hk))))
