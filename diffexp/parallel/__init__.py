"""Parallel training: FSDP2 sharding (`fsdp.py`) and memory per rank before a run starts (`memory.py`).

The FSDP2 names load on first use, so that `diffexp params --memory` reaches `memory.py` without Lightning."""

__all__ = ["FSDP2Strategy", "full_value", "is_sharded", "shard_decoder"]


def __getattr__(name: str):
    if name in __all__:
        from diffexp.parallel import fsdp

        return getattr(fsdp, name)
    raise AttributeError(f"module 'diffexp.parallel' has no attribute {name!r}")
