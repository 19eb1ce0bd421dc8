"""Models built on the meta device (shapes, no memory, any size) without torch's compiler stack, for counting.

In torch 2.13 arithmetic on meta tensors runs Python reference implementations that torch wraps to keep dynamo
out, and the first call of one imports torch._dynamo, with sympy and Triton: a second and more, most of
`diffexp params`'s start-up beyond torch, spent on values a meta tensor does not hold. A model's construction
does such arithmetic for its RoPE tables and its normal inits only. Under `building_on_meta()`:

- a normal init of a meta tensor (Tensor.normal_, nn.init.normal_, nn.init.trunc_normal_) leaves it as it is;
- arange and the elementwise, outer and concatenating calls RoPE makes (_SHAPE_ONLY), when a meta tensor goes
  in or arange would make one, run on zero-memory CPU stand-ins of the same shapes and dtypes (no value of the
  result is read) and give a meta tensor of the shape and dtype the call gives;
- every other call runs as under torch.device("meta").

Only construction: a forward pass on meta (diffexp.parallel.memory's estimate) needs autograd and runs as it is.
tests/test_recipe_params.py checks that every variant builds the same parameters and buffers (names, shapes,
dtypes) and counts as under torch.device("meta"); tests/test_startup.py that `params` imports no torch._dynamo.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

#: the calls that draw from a normal distribution in place (nn.init's go through Tensor.normal_ or these)
_NORMAL_INITS = (torch.Tensor.normal_, torch.nn.init.normal_, torch.nn.init.trunc_normal_)
#: calls whose result's shape and dtype follow from their arguments' shapes and dtypes alone
_SHAPE_ONLY = frozenset({
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__div__", "__rdiv__", "__pow__", "__rpow__", "__neg__", "add", "sub", "mul", "div", "true_divide", "pow",
    "neg", "reciprocal", "cos", "sin", "exp", "log", "sqrt", "rsqrt", "sigmoid", "tanh", "outer", "cat", "stack",
    "arange",
})


def _stand_in(value):
    """A meta tensor as a CPU tensor of its shape and dtype that holds one zero (expanded: no memory)."""
    if isinstance(value, torch.Tensor) and value.is_meta:
        return torch.zeros((), dtype=value.dtype, device="cpu").expand(value.shape)
    if isinstance(value, (list, tuple)):
        return type(value)(_stand_in(v) for v in value)
    return value


def _has_meta(value) -> bool:
    if isinstance(value, torch.Tensor):
        return value.is_meta
    return isinstance(value, (list, tuple)) and any(_has_meta(v) for v in value)


class _ShapesOnly(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _NORMAL_INITS:
            tensor = args[0] if args else kwargs.get("tensor")  # nn.init passes it by name
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        name = getattr(func, "__name__", "")
        if name == "arange" and kwargs.get("device") in (None, "meta", torch.device("meta")):
            result = func(*args, **{**kwargs, "device": "cpu"})  # a table's positions: small
        elif name in _SHAPE_ONLY and (_has_meta(args) or _has_meta(list(kwargs.values()))) \
                and "out" not in kwargs:
            result = func(*_stand_in(args), **{key: _stand_in(value) for key, value in kwargs.items()})
        else:
            return func(*args, **kwargs)
        if not isinstance(result, torch.Tensor):
            return result
        grad = torch.is_grad_enabled() and result.is_floating_point() and any(
            isinstance(v, torch.Tensor) and v.requires_grad for v in (*args, *kwargs.values()))
        return torch.empty(result.shape, dtype=result.dtype, device="meta", requires_grad=grad)


@contextlib.contextmanager
def building_on_meta():
    """Modules built inside are on the meta device, without the arithmetic that imports torch's compiler."""
    with torch.device("meta"), _ShapesOnly():
        yield
