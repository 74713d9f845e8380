"""Checkpoints: plain tensors and primitives only, written atomically, read with weights_only=True.

Nothing pickled goes in (no config objects, no classes): the resolved config is stored as a nested
dict of primitives and a checkpoint holding anything else is refused on load.

A checkpoint (see ``Trainer.state_dict``) holds: ``step``, ``model`` (the Projector: field AND
poses), ``optimizer``, ``scaler`` (GradScaler), ``plateau`` (adaptive schedule state or None),
``sampler`` (epoch, position and a fingerprint of the order), ``rng`` (one entry per rank:
torch CPU, CUDA when used, and the regularizer generator), ``world_size``, the logged
``history``/``val_history``, ``train_seconds`` and the resolved ``config``.
"""

from __future__ import annotations

import pickle
from pathlib import Path

import torch

FORMAT = "fasttomo-checkpoint-v1"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and the fix."""


def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Write ``state`` (plus the format tag) atomically to ``path`` (an existing file is replaced:
    checkpoints of one run supersede each other)."""
    from fasttomo.data.io.atomic import atomic_write

    path = Path(path)
    payload = {"format": FORMAT, **state}
    atomic_write(path, lambda tmp: torch.save(payload, tmp), overwrite=True)
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict:
    """Read a fasttomo checkpoint with ``torch.load(weights_only=True)``: tensors, numbers,
    strings, lists and dicts only. Anything else (a pickled class instance, a function, ...) is
    refused with :class:`CheckpointError`. Load to the CPU (the default): modules and optimizers
    copy their state to the right device, and RNG states must stay CPU byte tensors."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; give resume=<path to a .pt written by fasttomo>.")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            f"checkpoint {path} holds objects other than tensors and plain values and was refused "
            f"(weights_only loading): {str(exc).splitlines()[0]}. Only load checkpoints written by fasttomo."
        ) from exc
    except (RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: {exc}") from exc
    if not isinstance(state, dict) or state.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} is not a {FORMAT} file; was it written by fasttomo?")
    return state


def rng_state(device: torch.device, reg_generator: torch.Generator | None = None) -> dict:
    """This process's RNG states (CPU byte tensors): torch CPU, the CUDA device's (if used) and
    the regularizer generator's."""
    state = {"torch": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    if reg_generator is not None:
        state["reg"] = reg_generator.get_state()
    return state


def set_rng_state(state: dict, device: torch.device, reg_generator: torch.Generator | None = None) -> None:
    """Restore :func:`rng_state`'s states (accepts tensors mapped to any device)."""
    torch.set_rng_state(state["torch"].cpu())
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"].cpu(), device)
    if reg_generator is not None and "reg" in state:
        reg_generator.set_state(state["reg"].cpu())
