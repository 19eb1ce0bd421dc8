"""Every Triton kernel diffexp ships builds for an H100 (sm_90), and fits its shared memory, before any GPU is there.

tests/triton_aot.py compiles each kernel, forward and backward, down to the cubin as diffexp's own call launches it
(the default tiles of `triton_dint.tiles`, Triton's default warps and stages), for an input dtype and head widths.
A kernel that asks for more shared memory than a block may have is refused at its first launch on the GPU; here it
fails on any machine with Triton. The default run builds bf16 at the recipes' two head shapes (d 64, v 128 and
d 128, v 256); the other dtypes and widths, and GQA, are under `-m heavy` (an fp32 kernel takes minutes of a
CPU: its exact "ieee" products make long PTX). Triton keeps what it built in its cache, so a second run takes
seconds.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="the triton package is not installed (CUDA builds of torch bring it)")
try:
    from triton.backends import backends
except ImportError:  # a Triton without pluggable backends predates the compiler interface the build uses
    backends = {}
if "nvidia" not in backends:
    pytest.skip("this Triton has no NVIDIA backend to compile for an H100 with", allow_module_level=True)

from diffexp.kernels.triton_dint import tiles  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
#: an H100's (and H200's) shared memory per block, opted in: cudaDevAttrMaxSharedMemoryPerBlockOptin, 227 KiB
H100_SHARED = 232448
BF16, FP16, FP32 = "bfloat16", "float16", "float32"
WIDTHS = [(64, 128), (128, 256), (64, 64), (128, 128)]  # (d, dv): the recipes' DINT heads (v 2d wide), then v d wide
DEFAULT = {(BF16, 64, 128, "mha"), (BF16, 128, 256, "mha")}


def case(dtype, d, dv, layout):
    block_m, block_n = tiles(d, dv)
    marks = () if (dtype, d, dv, layout) in DEFAULT else pytest.mark.heavy
    return pytest.param(dtype, d, dv, layout, marks=marks, id=f"{dtype}-d{d}-v{dv}-{layout}-tiles{block_m}x{block_n}")


CASES = [case(dtype, d, dv, "mha") for dtype in (BF16, FP16, FP32) for d, dv in WIDTHS] + [case(BF16, 64, 128, "gqa")]


def build(dtype: str, d: int, dv: int, layout: str) -> dict:
    """Every launch of DINT's integral compiled for sm_90, in a process without the test session's interpreter."""
    hk = 2 if layout == "mha" else 1  # two query heads, each its own kv head or a group of two on one
    done = subprocess.run([sys.executable, "-m", "tests.triton_aot", dtype, str(d), str(dv), str(hk)], cwd=ROOT,
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, f"the build failed:\n{done.stderr[-6000:]}"
    return json.loads(done.stdout)


def narrow_uses_of_program_id_1(ttir: str) -> list[str]:
    """The IR lines that use program id 1 (a kernel's batch and head) other than to widen it to int64."""
    name = re.escape(re.search(r"(%\w+) = tt\.get_program_id y : i32", ttir).group(1))
    uses = [line.strip() for line in ttir.splitlines() if re.search(name + r"\b(?! =)", line)]
    return [use for use in uses if not re.search(r"= arith\.extsi " + name + r" : i32 to i64", use)]


@pytest.mark.parametrize("dtype, d, dv, layout", CASES)
def test_every_kernel_builds_for_an_h100(dtype, d, dv, layout):
    result = build(dtype, d, dv, layout)
    built = {entry["kernel"] for entry in result["builds"]}
    assert built == set(result["kernels"]), (
        f"kernels diffexp ships that this build never launched: {sorted(set(result['kernels']) - built)}; "
        "give them a call in tests/triton_aot.py")
    block_m, block_n = result["tiles"]
    for entry in result["builds"]:
        label = f"{entry['kernel']} (KEYS={entry.get('KEYS')}, Triton {result['triton']})"
        assert (entry["BLOCK_M"], entry["BLOCK_N"]) == (block_m, block_n), label
        assert 0 < entry["shared"] <= H100_SHARED, f"{label}: {entry['shared']} bytes of shared memory"
        assert narrow_uses_of_program_id_1(entry["ttir"]) == [], f"{label}: 32-bit batch and head offsets"


def test_a_kernel_that_uses_program_id_1_as_int32_is_found():
    ttir = ("%0 = tt.get_program_id y : i32 loc(#loc1)\n%1 = arith.extsi %0 : i32 to i64 loc(#loc1)\n"
            "%10 = arith.divsi %0, %H : i32 loc(#loc2)\n")
    assert narrow_uses_of_program_id_1(ttir) == ["%10 = arith.divsi %0, %H : i32 loc(#loc2)"]
    assert narrow_uses_of_program_id_1(ttir.replace("%0, %H", "%1, %H")) == []
