"""An inductor pass for the CPU decoding step: each one-row product with a weight matrix split in two halves.

At batch 1 every product with the weights has one row. Inductor writes it as one vector sum per output (see
`decoder._cpu_step_options`): a chain of dependent adds, which reads the weights far below what the caches deliver.
Split into two products over the two halves of the outputs, which inductor fuses back into one loop, each
iteration runs two independent chains. Every output is still the same sum in the same order.
"""

from __future__ import annotations

import hashlib
import inspect

import torch

try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
    HAVE_CUSTOM_PASSES = True
except ImportError:  # an older torch: no custom passes, the step compiles without this one
    CustomGraphPass, HAVE_CUSTOM_PASSES = object, False

MIN_OUTPUTS = 64  # narrower products (DIFF V2's lambda projection) gain nothing


def _split(graph: torch.fx.Graph) -> None:
    aten = torch.ops.aten
    for node in list(graph.find_nodes(op="call_function", target=aten.mm.default)):
        x, w = node.args
        xv, wv = x.meta.get("val"), w.meta.get("val")
        if xv is None or wv is None or xv.shape[0] != 1 or wv.device.type != "cpu":
            continue
        outputs = wv.shape[1]
        if not isinstance(outputs, int) or outputs < MIN_OUTPUTS or outputs % 2:
            continue
        half = outputs // 2
        with graph.inserting_before(node):
            parts = []
            for start in (0, half):
                columns = graph.call_function(aten.slice.Tensor, (w, 1, start, start + half))
                columns.meta["val"] = aten.slice.Tensor(wv, 1, start, start + half)
                part = graph.call_function(aten.mm.default, (x, columns))
                part.meta["val"] = aten.mm.default(xv, columns.meta["val"])
                parts.append(part)
            joined = graph.call_function(aten.cat.default, (parts, 1))
            joined.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(joined)
        graph.erase_node(node)


class SplitOneRowProducts(CustomGraphPass):
    def __call__(self, graph: torch.fx.Graph) -> None:
        _split(graph)

    def uuid(self) -> str:  # inductor's cache key: a compiled step is reused only while the pass is unchanged
        try:
            return hashlib.sha256(f"{inspect.getsource(_split)}/{MIN_OUTPUTS}".encode()).hexdigest()
        except OSError:  # no source to read
            return f"{__name__}.SplitOneRowProducts/{MIN_OUTPUTS}"


def split_pass() -> SplitOneRowProducts | None:
    """The pass, for inductor's `post_grad_custom_pre_pass` (None where this torch takes no custom passes)."""
    return SplitOneRowProducts() if HAVE_CUSTOM_PASSES else None
