"""Inductor's pre-pass for the CPU decoding step: how its products with the weight matrices are laid out.

- **Narrow products join their neighbours** (more than one row). A product with a few outputs (DIFF V2's lambda
  projection, Shared DIFF's low-rank factors) costs a GEMM call for little work. Where one input feeds several
  products with the weights and one of them is narrow, they become one product with the weights side by side,
  and each result a slice of it.
- **One-row products split in two** (batch 1). Inductor writes a one-row product as one vector sum per output (see
  `decoder._cpu_step_options`): a chain of dependent adds, which reads the weights far below what the caches
  deliver. Split into two products over the halves of the outputs, which inductor fuses back into one loop, each
  iteration runs two independent chains.

Every output is the same sum as before: the joined weights hold each output's column as it was.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools

import torch

try:
    from torch._inductor.custom_graph_pass import CustomGraphPass
    HAVE_CUSTOM_PASSES = True
except ImportError:  # an older torch: no custom passes, the step compiles without this one
    CustomGraphPass, HAVE_CUSTOM_PASSES = object, False

MIN_OUTPUTS = 64  # a product with fewer outputs is narrow: too little work to split, or for a call of its own


def _join(graph: torch.fx.Graph) -> None:
    """Products of one many-row input with constant weights (a frozen step's), one of them narrow, as one."""
    aten = torch.ops.aten
    module = graph.owning_module
    by_input: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for node in graph.find_nodes(op="call_function", target=aten.mm.default):
        x, w = node.args
        xv, wv = x.meta.get("val"), w.meta.get("val")
        if module is None or w.op != "get_attr" or xv is None or wv is None or wv.device.type != "cpu":
            continue
        if isinstance(xv.shape[0], int) and xv.shape[0] > 1:
            by_input.setdefault(x, []).append(node)
    for x, products in by_input.items():
        weights = [_attribute(module, node.args[1].target) for node in products]
        widths = [w.shape[1] for w in weights]
        if len(products) < 2 or min(widths) >= MIN_OUTPUTS or len({(w.shape[0], w.dtype) for w in weights}) > 1:
            continue
        joined = torch.cat([w.t() for w in weights]).t()  # each output's column contiguous, as in the weights
        name = next(f"_joined_products_{i}" for i in itertools.count() if not hasattr(module, f"_joined_products_{i}"))
        module.register_buffer(name, joined)
        fake_mode = x.meta["val"].fake_mode
        with graph.inserting_before(products[0]):
            w = graph.get_attr(name)
            w.meta["val"] = fake_mode.from_tensor(joined)
            product = graph.call_function(aten.mm.default, (x, w))
            product.meta["val"] = aten.mm.default(x.meta["val"], w.meta["val"])
            start = 0
            for node, width in zip(products, widths):
                part = graph.call_function(aten.slice.Tensor, (product, 1, start, start + width))
                part.meta["val"] = aten.slice.Tensor(product.meta["val"], 1, start, start + width)
                node.replace_all_uses_with(part)
                start += width
        for node in products:
            graph.erase_node(node)


def _attribute(module: torch.nn.Module, target: str) -> torch.Tensor:
    """The tensor a get_attr node names ("a.b.c" reads through submodules)."""
    return functools.reduce(getattr, target.split("."), module)


def _split(graph: torch.fx.Graph) -> None:
    """Each one-row product with an even number of outputs, MIN_OUTPUTS or more, as two over the halves."""
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


class StepProducts(CustomGraphPass):
    def __init__(self, weights_key: str = "") -> None:
        self.weights_key = weights_key

    def __call__(self, graph: torch.fx.Graph) -> None:
        _join(graph)
        _split(graph)

    def uuid(self) -> str:  # inductor's cache key: a compiled step is reused only while the pass is unchanged
        try:
            source = inspect.getsource(_join) + inspect.getsource(_split)
        except OSError:  # no source to read
            source = f"{__name__}.StepProducts"
        return hashlib.sha256(f"{source}/{MIN_OUTPUTS}/{self.weights_key}".encode()).hexdigest()


def step_pass(weights_key: str = "") -> StepProducts | None:
    """The pass, for inductor's `post_grad_custom_pre_pass` (None where this torch takes no custom passes).
    weights_key joins its cache key: see `Decoder.compile_decoding`."""
    return StepProducts(weights_key) if HAVE_CUSTOM_PASSES else None
