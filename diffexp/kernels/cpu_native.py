"""The two-map variants' attention as a compiled CPU kernel (cpu/two_map_attention.cpp), forward and backward.

Per block of query rows and head, both maps' logits come from BLAS, the softmax rows, A = A1 - lambda A2
(+ gamma A3 for DINT) and the backward's row sums run in one vectorised loop per row, and one product with V
serves all maps. That is the baseline's matmul work plus one more Q K^T: DIFF V1, Shared DIFF and DIFF V2 execute
3 (forward) and 6 (backward) T^2 d-products per head pair instead of the 4 and 8 of one attention call per map.
Only Q, K, V and the maps' row logsumexps are saved; backward recomputes each block's maps.

    forward   A_m = softmax(scale Q_m K_m^T) (causal)        out = (A1 - lambda A2 [+ gamma A3]) V
    backward  dA = dO V^T     dV = A^T dO     dS_m = c_m A_m (dA_m - rowsum(A_m dA_m))     c = (1, -lambda)
              dQ_m = scale dS_m K_m     dK_m = scale dS_m^T Q_m     dlambda = -rowsum(A2 dA)
    DINT      G[n] = mean of A1's rows 0..n, A3 = causal softmax of G; dA1 = dA + sum_{n>=m} dG[n] / n,
              dG = gamma A3 (dA - rowsum(A3 dA)); forward carries A1's column sums down the rows, backward
              peels them off going up (one task per head), so memory stays O(block x T).

The kernel is compiled on first use with the C++ compiler torch's extensions use (about 10 s on 2 cores; kept
under torch's extension directory, keyed by a digest of the source, the build flags and torch's version). Where it
cannot be built (no compiler, no BLAS symbol, DIFFEXP_CPU_KERNEL=0) the model runs its plain path, with one
warning. fp32 math; bf16 is cast in and out; fp64 runs the plain path. Registered as kernel "cpu_native".
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch

from diffexp.kernels.registry import Kernel, constant_result, register

SOURCE = Path(__file__).with_name("cpu") / "two_map_attention.cpp"
#: set to 0 to never build the kernel (the plain path runs instead)
SWITCH = "DIFFEXP_CPU_KERNEL"
#: query rows per block: 64 for the two maps, 32 for DINT (measured fastest on 2 cores at T 512 and 2048)
TWO_MAP_BLOCK, DINT_BLOCK = 64, 32

#: hot loops at cache-line boundaries: unaligned, a loop's speed depends on where the linker happens to place it
_ALIGN_FLAGS = ["-falign-functions=64", "-falign-loops=64"]
_VECTOR_FLAGS = {"AVX512": ["-mavx2", "-mfma", "-mavx512f", "-mavx512dq", "-mavx512bw", "-mavx512vl"],
                 "AVX2": ["-mavx2", "-mfma"]}


def _ensure_ninja_on_path() -> None:
    """torch builds extensions with ninja; a venv that was not activated has the pip package's ninja off PATH."""
    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _build_settings(capability: str) -> tuple[str, list[str], Path]:
    """The extension's name, its compiler flags and its build directory. The name carries a digest of the source,
    the flags, torch's version and the source's path: two checkouts on one machine (ninja rebuilds when the source
    path in its build file changes), or two versions of the source, build and keep their own library instead of
    rebuilding each other's."""
    from torch.utils import cpp_extension

    flags = ["-O3", "-fopenmp", *_ALIGN_FLAGS, *_VECTOR_FLAGS.get(capability, [])]
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update("\0".join([*flags, capability, torch.__version__, str(SOURCE.resolve())]).encode())
    name = f"diffexp_cpu_attention_{digest.hexdigest()[:16]}"
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root()  # torch's own rule
    return name, flags, Path(root) / "diffexp" / name


@functools.cache
def unavailable_reason() -> str | None:
    """None once the kernel is loaded (built on the first call), else why it cannot run."""
    if os.environ.get(SWITCH, "1").lower() in ("0", "off", "false", "no"):
        return f"{SWITCH}={os.environ[SWITCH]}"
    from torch.utils import cpp_extension

    capability = torch.backends.cpu.get_cpu_capability()
    _ensure_ninja_on_path()
    started = time.perf_counter()
    try:
        name, flags, build_directory = _build_settings(capability)
        library = build_directory / f"{name}.so"
        built_before = library.exists()
        build_directory.mkdir(parents=True, exist_ok=True)
        cpp_extension.load(name=name, sources=[str(SOURCE)], is_python_module=False, verbose=False,
                           extra_cflags=flags, extra_ldflags=["-fopenmp"], build_directory=str(build_directory))
    except Exception as error:  # no compiler, no ninja, a BLAS without sgemm_: the plain path runs instead
        first_line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        return f"building {SOURCE.name} failed: {first_line[:300]}"
    _register_fakes()
    if not built_before:  # stderr: never into text a command writes on stdout
        print(f"diffexp: compiled the CPU attention kernel in {time.perf_counter() - started:.0f} s "
              f"({build_directory}, kept for later runs)", file=sys.stderr)
    return None


def _register_fakes() -> None:
    """Shape-only versions of the ops, so that torch.compile (model.compile) traces them as opaque calls."""
    lib = torch.library

    @lib.register_fake("diffexp_cpu::two_map_forward")
    def _(q1, q2, k1, k2, v, lam, scale, block_rows):
        b, h, t, _ = q1.shape
        return q1.new_empty(b, h, t, v.shape[-1]), q1.new_empty(b, h, 2, t)

    @lib.register_fake("diffexp_cpu::two_map_backward")
    def _(grad_out, q1, q2, k1, k2, v, lam, lse, scale, block_rows):
        return [torch.empty_like(t) for t in (q1, q2, k1, k2, v, lam)]

    @lib.register_fake("diffexp_cpu::dint_forward")
    def _(q1, q2, k1, k2, v, lam, gamma, scale, block_rows):
        b, h, t, _ = q1.shape
        return q1.new_empty(b, h, t, v.shape[-1]), q1.new_empty(b, h, 3, t), q1.new_empty(b, h, t)

    @lib.register_fake("diffexp_cpu::dint_backward")
    def _(grad_out, q1, q2, k1, k2, v, lam, gamma, lse, col_sums, scale, block_rows):
        return [torch.empty_like(t) for t in (q1, q2, k1, k2, v, lam, lam)]


_warned: list[bool] = []


@constant_result  # torch.compile reads it once while tracing, not the build inside
def available() -> bool:
    """Whether the kernel runs (building it on the first call); warns once when it cannot."""
    reason = unavailable_reason()
    if reason is not None and not _warned:
        _warned.append(True)
        warnings.warn(f"diffexp's CPU attention kernel is unavailable ({reason}); the two-map variants run "
                      "the slower plain path (one attention call per map)", stacklevel=2)
    return reason is None


def _fp32(*tensors: torch.Tensor) -> list[torch.Tensor]:
    return [t.detach().to(torch.float32).contiguous() for t in tensors]


class NativeTwoMap(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q1, q2, k1, k2, v, lam_rows, block_rows: int):
        inputs = _fp32(q1, q2, k1, k2, v, lam_rows)
        ctx.scale, ctx.block_rows = q1.shape[-1] ** -0.5, block_rows
        out, lse = torch.ops.diffexp_cpu.two_map_forward(*inputs, ctx.scale, block_rows)
        ctx.save_for_backward(*inputs, lse)
        ctx.dtypes = [t.dtype for t in (q1, q2, k1, k2, v, lam_rows)]
        # not a no-op out.to(v.dtype): torch 2.11's compile gives zero gradients to an autograd.Function whose
        # forward returns such an alias
        return out if out.dtype == v.dtype else out.to(v.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        grads = torch.ops.diffexp_cpu.two_map_backward(grad_out.to(torch.float32).contiguous(), *ctx.saved_tensors,
                                                       ctx.scale, ctx.block_rows)
        return (*(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes, strict=True)), None)


class NativeDint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q1, q2, k1, k2, v, lam_rows, gamma, block_rows: int):
        inputs = _fp32(q1, q2, k1, k2, v, lam_rows)
        gamma32 = gamma.detach().to(torch.float32)  # a tensor, not float(gamma): torch.compile traces no host read
        ctx.scale, ctx.block_rows = q1.shape[-1] ** -0.5, block_rows
        out, lse, col_sums = torch.ops.diffexp_cpu.dint_forward(*inputs, gamma32, ctx.scale, block_rows)
        ctx.save_for_backward(*inputs, gamma32, lse, col_sums)
        ctx.dtypes = [t.dtype for t in (q1, q2, k1, k2, v, lam_rows)] + [gamma.dtype]
        # not a no-op out.to(v.dtype): torch 2.11's compile gives zero gradients to an autograd.Function whose
        # forward returns such an alias
        return out if out.dtype == v.dtype else out.to(v.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q1, q2, k1, k2, v, lam_rows, gamma, lse, col_sums = ctx.saved_tensors
        *grads, d_gamma_rows = torch.ops.diffexp_cpu.dint_backward(
            grad_out.to(torch.float32).contiguous(), q1, q2, k1, k2, v, lam_rows, gamma, lse, col_sums, ctx.scale,
            ctx.block_rows)
        grads = [*grads, d_gamma_rows.sum()]  # not grads.append: torch 2.11's dynamo makes grads a tuple
        return (*(g.to(dtype) for g, dtype in zip(grads, ctx.dtypes, strict=True)), None)


def _lambda_rows(lam, q: torch.Tensor) -> torch.Tensor:
    """lambda per (batch, head, row): a 0-d lambda expanded (its gradient sums back), or a (B, h, T) one as is."""
    b, h, t, _ = q.shape
    lam = torch.as_tensor(lam, dtype=torch.float32, device=q.device)
    return lam.expand(b, h, t)


def two_map(q1, q2, k1, k2, v, lam, block_rows: int = TWO_MAP_BLOCK) -> torch.Tensor:
    """(A1 - lambda A2) V over whole causal sequences. q1, q2: (B, h, T, d); k1, k2: (B, h_kv, T, d);
    v: (B, h_kv, T, dv), query head p reading kv head p // (h / h_kv); lam: 0-d or (B, h, T).
    Returns (B, h, T, dv)."""
    if k2 is k1:  # DIFF V2's pair reads one K; torch.compile refuses one tensor twice (a view sums the grads back)
        k2 = k1.view(k1.shape)
    return NativeTwoMap.apply(q1, q2, k1, k2, v, _lambda_rows(lam, q1), block_rows)


def dint_head(q1, q2, k1, k2, v, lam, gamma: torch.Tensor, block_rows: int = DINT_BLOCK) -> torch.Tensor:
    """(A1 - lambda A2 + gamma A3) V, DINT's softmax integral; shapes as `two_map`, lam and gamma 0-d."""
    return NativeDint.apply(q1, q2, k1, k2, v, _lambda_rows(lam, q1), gamma, block_rows)


def head(q1, q2, k1, k2, v, lam, integral=None) -> torch.Tensor:
    """The door's call (diffexp.kernels.registry); lam 0-d or (B, h, T, 1)."""
    if integral is None:
        return two_map(q1, q2, k1, k2, v, lam.squeeze(-1) if lam.dim() else lam)
    return dint_head(q1, q2, k1, k2, v, lam, integral.gamma)


def refuses(q1: torch.Tensor, k1: torch.Tensor, v: torch.Tensor, integral: str | None) -> str | None:
    if q1.device.type != "cpu":
        return "CPU tensors only"
    if q1.dtype == torch.float64:
        return "computes in fp32 (fp64 runs the plain path, exactly)"
    if integral == "mean":
        return "DINT's mean integral is cumsum(A1 V) / n on the plain path"
    return None if available() else f"unavailable: {unavailable_reason()}"


register(Kernel("cpu_native", head, ("cpu",), refuses, "the compiled CPU kernel: both maps, lambda and DINT's softmax "
                "integral per block of query rows, one product with V", token_lambda=True))
