"""Fast attention behind one door (registry.py): each module here registers a two-map head that computes what
the model's plain path computes, and passes the same reference tests. Order is preference.

    cpu_native    the compiled CPU kernel (CPU training: the tiny runs, the test suite)
    sdpa_joined   DIFF V1 / Shared DIFF: both maps in one SDPA call, V at full width (CUDA, half precision)
    gpu_dint      DINT: flex_attention's log-sum-exp and a Triton integral (CUDA; Triton's interpreter in tests)

and the decoding step's replay on a GPU, a CUDA graph (cuda_graph.py).
"""

from diffexp.kernels import cpu_native, cuda_graph, gpu_dint, sdpa_joined  # noqa: F401  (each registers itself)
from diffexp.kernels.registry import (
                                     PLAIN,
                                     Integral,
                                     Kernel,
                                     kernels,
                                     recording,
                                     register,
                                     register_step_replay,
                                     resolve,
                                     step_replay,
                                     use,
)

__all__ = ["PLAIN", "Integral", "Kernel", "kernels", "recording", "register", "register_step_replay", "resolve",
           "step_replay", "use"]
