"""FSDP2 for diffexp: one sharded training path for GPUs (NCCL, bf16) and CPU processes (gloo, fp32).

`FSDP2Strategy` (trainer.strategy.class_path: diffexp.parallel.FSDP2Strategy) is Lightning's
ModelParallelStrategy with diffexp's settings as init_args; `shard_decoder` applies FSDP2's `fully_shard` to every
decoder block, then to the root, as torchtitan does.
"""

from __future__ import annotations

import secrets
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, NoReturn

import torch
from torch import nn

from diffexp.checkpoint_io import file_sha256, no_space_error, save_failed_for_space, tensor_bytes, write_checksums
from diffexp.errors import UserError, invalid
from diffexp.lightning_internals import StrategyInternals

MIXED_PRECISION = ("auto", "bf16", "fp32")


class FSDP2Strategy(StrategyInternals):
    """FSDP2 (per-parameter sharding, torch.distributed.fsdp.fully_shard) over every process of the run.

    Args:
        mixed_precision: "bf16": parameters gathered and computed in bf16, gradients reduced in fp32, fp32
            master weights and optimizer state; "fp32": everything in fp32; "auto": bf16 on GPUs, fp32 on CPU.
        activation_checkpointing: recompute each decoder block in the backward instead of keeping its
            activations (about a third more compute for a fraction of the activation memory).
        replicate_across_nodes: HSDP, a 2-D mesh (num_nodes x devices): shard within a node, replicate across
            nodes, so the all-gathers stay on the fast intra-node links. Off: shard over all ranks.
        save_distributed_checkpoint: each rank writes its shards (a checkpoint directory); false gathers the
            full weights on rank 0 into one .ckpt file (slow and memory-hungry at the papers' sizes).
        process_group_backend: nccl on GPUs and gloo on CPU unless set.
        timeout: of the collectives.
    """

    def __init__(self, mixed_precision: Literal["auto", "bf16", "fp32"] = "auto",
                 activation_checkpointing: bool = False, replicate_across_nodes: bool = False,
                 save_distributed_checkpoint: bool = True, process_group_backend: str | None = None,
                 timeout: timedelta | None = timedelta(minutes=30)) -> None:
        if mixed_precision not in MIXED_PRECISION:
            raise invalid("trainer.strategy.init_args.mixed_precision", mixed_precision,
                          f"expected one of {', '.join(MIXED_PRECISION)}")
        super().__init__(save_distributed_checkpoint=save_distributed_checkpoint,
                         process_group_backend=process_group_backend, timeout=timeout)
        self.mixed_precision = mixed_precision
        self.save_distributed_checkpoint = save_distributed_checkpoint
        self.activation_checkpointing = activation_checkpointing
        self.replicate_across_nodes = replicate_across_nodes
        self.estimated_memory: int | None = None  # bytes per rank, from check_memory

    # -- the mesh: every rank is a data-parallel rank ----------------------------------------------------
    def setup_environment(self) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        self.setup_distributed()
        if self.replicate_across_nodes and self.num_nodes > 1:
            shape, names = (self.num_nodes, self.num_processes), ("replicate", "shard")
        else:
            shape, names = (self.world_size,), ("shard",)
        self.use_device_mesh(init_device_mesh(self.root_device.type, shape, mesh_dim_names=names))

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the forward and backward matmuls (for MFU's peak FLOP/s)."""
        if self.mixed_precision == "bf16" or (self.mixed_precision == "auto" and self.root_device.type == "cuda"):
            return torch.bfloat16
        return torch.float32

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        """Every rank writes its shards into a staging directory beside the target, which rank 0 then swaps
        in: a kill leaves the previous checkpoint or the new one, never a partial one (a kill between the two
        renames leaves the new one under its staging name). A save that fails on one rank (a full disk) fails on
        all of them, rather than leaving the others waiting at the next collective; the staging directory is
        removed and the previous checkpoint stays as it was. The directory holds SHA256SUMS, each file's SHA-256
        (every rank hashes the shards it wrote), which diffexp.checkpoint_io checks before reading it."""
        if not self.save_distributed_checkpoint:  # one file, written by rank 0 (AtomicCheckpointIO)
            failure = _save_error(super().save_checkpoint, checkpoint, filepath, storage_options)
            if self.reduce_boolean_decision(failure is not None, all=False):
                _raise_on_every_rank(failure, Path(filepath))
            return
        target = Path(self.broadcast(str(filepath)))
        token = self.broadcast(secrets.token_hex(4))
        staging = target.with_name(f".{target.name}.{token}.tmp")  # diffexp.training.runs removes orphans
        needed = tensor_bytes(checkpoint)  # before Lightning moves the tensors out of the dict

        def settle(failure: BaseException | None) -> None:  # every rank calls it: fails on all if one failed
            no_space = failure is not None and save_failed_for_space(failure, staging, needed)  # before space is freed
            if self.reduce_boolean_decision(failure is not None, all=False):
                if self.is_global_zero:
                    shutil.rmtree(staging, ignore_errors=True)
                self.barrier("diffexp-checkpoint-removed")  # so every rank reports the space left after it
                if no_space:
                    raise no_space_error(target, needed) from failure
                _raise_on_every_rank(failure, target)

        settle(_save_error(super().save_checkpoint, checkpoint, staging, storage_options))
        self.barrier("diffexp-checkpoint-written")
        settle(_save_error(_write_shard_sums, staging, self.global_rank, self.world_size))
        if self.is_global_zero:
            replaced = target.with_name(f".{target.name}.{token}-old.tmp")
            if target.is_dir():
                target.rename(replaced)
            elif target.exists():
                target.unlink()
            staging.rename(target)
            shutil.rmtree(replaced, ignore_errors=True)
        self.barrier("diffexp-checkpoint-in-place")

    def describe(self) -> str:
        mesh = " x ".join(f"{n} {name}" for n, name in zip(self.device_mesh.shape, self.device_mesh.mesh_dim_names))
        precision = "bf16 compute, fp32 reduce" if self.compute_dtype == torch.bfloat16 else "fp32"
        checkpointing = ", activation checkpointing" if self.activation_checkpointing else ""
        return f"FSDP2 over {self.world_size} rank(s) ({mesh}; {self.root_device.type}), {precision}{checkpointing}"

    def check_memory(self, arch, micro_batch: int, seq_len: int, loss) -> str:
        """The memory per rank this run needs with the trainer's `loss` (diffexp.parallel.memory); refuses a run
        that cannot fit."""
        from diffexp.parallel.memory import check_fits, estimate_memory

        available = None
        if self.root_device.type == "cuda":
            available = torch.cuda.get_device_properties(self.root_device).total_memory
        shards = self.device_mesh["shard"].size()
        estimate = estimate_memory(arch, micro_batch, seq_len, shards, self.compute_dtype,
                                   self.activation_checkpointing, loss=loss)
        self.estimated_memory = estimate.total  # printed beside the measured peak at the end of fit
        return check_fits(arch, micro_batch, seq_len, shards, self.compute_dtype, self.activation_checkpointing,
                          available, estimate, loss=loss)

    def shard(self, decoder: nn.Module) -> None:
        """Shard a Decoder in place with this strategy's mesh and precision (DiffexpLM.configure_model)."""
        shard_decoder(decoder, self.device_mesh, self.compute_dtype, self.activation_checkpointing)


def _save_error(save, *args: Any) -> BaseException | None:
    """Call save; its error instead of raising it, so that the ranks can decide together."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        save(*args)
    except (Exception, CheckpointException) as err:  # CheckpointException is a BaseException
        return err
    return None


def _raise_on_every_rank(failure: BaseException | None, target: Path) -> NoReturn:
    if failure is None:  # this rank's part was written: the failing rank's error says why
        raise UserError(f"saving the checkpoint {target} failed on another process; its error says why")
    raise failure


def _write_shard_sums(staging: Path, rank: int, world_size: int) -> None:
    """SHA256SUMS of a sharded checkpoint's staging directory: each rank hashes the shards it wrote
    (torch.distributed.checkpoint names them __<rank>_<n>.distcp), rank 0 gathers the sums, hashes the rest (the
    index, Lightning's meta.pt, any shard a rank could not read) and writes the file. A collective."""
    import torch.distributed as dist

    try:
        mine = {p.name: file_sha256(p) for p in staging.glob(f"__{rank}_*.distcp")}
    except OSError:
        mine = {}  # rank 0 hashes what is left
    gathered: list[dict[str, str] | None] = [mine]
    if world_size > 1 and dist.is_initialized():
        gathered = [None] * world_size
        dist.all_gather_object(gathered, mine)
    if rank == 0:
        write_checksums(staging, {name: digest for sums in gathered for name, digest in (sums or {}).items()})


def is_sharded(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def shard_decoder(decoder: nn.Module, mesh, compute_dtype: torch.dtype = torch.float32,
                  activation_checkpointing: bool = False) -> None:
    """fully_shard each decoder block, then the root; a mesh with a "replicate" dimension gives HSDP.

    The root's parameters (embedding, final norm, LM head: one unit) stay gathered after the forward, since
    the backward starts with them.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if is_sharded(decoder):  # configure_model runs again for a validate or test after fit
        return
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    decoder.checkpoint_activations = activation_checkpointing
    for block in decoder.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(decoder, mesh=mesh, mp_policy=policy, reshard_after_forward=False)


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every rank calls it); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
