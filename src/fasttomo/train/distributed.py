"""Small torch.distributed helpers (torchrun: NCCL on GPUs, gloo on CPUs).

Nothing here reads the environment at import time: :func:`init_distributed` reads torchrun's
variables (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT) when it is called. Everything
else asks torch.distributed's own state, so single-process runs need no special casing.
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

__all__ = ["dist_info", "is_distributed", "all_reduce_mean", "init_distributed",
           "broadcast_object", "all_gather_object", "destroy_distributed"]


def is_distributed() -> bool:
    """True when a process group is initialized."""
    return dist.is_available() and dist.is_initialized()


def _local_rank(rank: int) -> int:
    value = os.environ.get("LOCAL_RANK")
    return int(value) if value is not None else rank


def dist_info() -> tuple[int, int, int]:
    """(rank, world_size, local_rank); (0, 1, 0) when no process group is initialized."""
    if not is_distributed():
        return 0, 1, 0
    rank = dist.get_rank()
    return rank, dist.get_world_size(), _local_rank(rank)


def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Mean of ``tensor`` over all ranks, as a new tensor (the input is left unchanged).

    Returns ``tensor`` itself when no process group is initialized (or world size 1). Integer
    tensors are averaged in float32. Collective: every rank must call it, in the same order.
    """
    if not is_distributed() or dist.get_world_size() == 1:
        return tensor
    out = tensor.detach().clone() if tensor.is_floating_point() else tensor.detach().to(torch.float32)
    dist.all_reduce(out, op=dist.ReduceOp.SUM)  # AVG is NCCL-only; SUM then divide works on gloo too
    out /= dist.get_world_size()
    return out


def init_distributed(device_kind: str | torch.device = "cpu", *, timeout_s: float = 600.0) -> bool:
    """Initialize the process group from torchrun's environment when WORLD_SIZE > 1.

    ``device_kind``: "cuda" (or "cuda:N" / a torch.device) selects NCCL and binds this process
    to GPU LOCAL_RANK; anything else selects gloo. Returns True when the process is (now)
    distributed, False for a single-process run (WORLD_SIZE unset or 1: nothing is done).
    ``timeout_s`` bounds every collective so a desynchronized rank fails instead of hanging.
    """
    if is_distributed():
        return True
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return False
    if not dist.is_available():
        raise RuntimeError("WORLD_SIZE > 1 but this torch build has no torch.distributed support.")
    missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if missing:
        raise RuntimeError(
            f"WORLD_SIZE={world_size} but {missing} are not set; launch with torchrun "
            "(e.g. torchrun --standalone --nproc-per-node=N -m fasttomo.cli.reconstruct ...)."
        )
    rank = int(os.environ["RANK"])
    kind = torch.device(device_kind).type
    timeout = datetime.timedelta(seconds=timeout_s)
    if kind == "cuda":
        local_rank = _local_rank(rank)
        if local_rank >= torch.cuda.device_count():
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but only {torch.cuda.device_count()} CUDA device(s) are visible; "
                "use --nproc-per-node <= the number of GPUs."
            )
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, timeout=timeout,
                                device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timeout)
    return True


def destroy_distributed() -> None:
    """Tear the process group down (end of run); nothing when not distributed."""
    if is_distributed():
        dist.destroy_process_group()


def broadcast_object(obj):
    """Rank 0's ``obj`` (a small picklable value) on every rank; ``obj`` itself when not distributed.
    Used for the run folder (each rank's Hydra may pick its own time-stamped one) and for errors
    found on rank 0 only, so that every rank stops instead of waiting at the next collective."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_gather_object(obj) -> list:
    """Every rank's ``obj`` (a small picklable value), as a list indexed by rank; ``[obj]`` when
    not distributed. Collective: every rank must call it. Used for the per-rank RNG states that
    go into a checkpoint (only rank 0 writes it, but every rank resumes its own stream)."""
    if not is_distributed():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
