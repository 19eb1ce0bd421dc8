"""Parallel training: FSDP2 sharding (`fsdp.py`) and memory per rank before a run starts (`memory.py`)."""

from diffexp.parallel.fsdp import FSDP2Strategy, full_value, is_sharded, shard_decoder

__all__ = ["FSDP2Strategy", "full_value", "is_sharded", "shard_decoder"]
