"""Checkpoints: plain tensors and primitives only, written atomically, read with weights_only=True,
and verified against a checksum of their contents.

Nothing pickled goes in (no config objects, no classes): the resolved config is stored as a nested
dict of primitives and a checkpoint holding anything else is refused on load.

A checkpoint (see ``Trainer.state_dict``) holds: ``step``, ``model`` (the Projector: field AND
poses), ``optimizer``, ``scaler`` (GradScaler), ``plateau`` (adaptive schedule state or None),
``sampler`` (epoch, position and a fingerprint of the order), ``rng`` (one entry per rank:
torch CPU, CUDA when used, and the regularizer generator), ``guard`` (the divergence guard's
counters and learning-rate factor), ``world_size``, the logged ``history``/``val_history``,
``train_seconds`` and the resolved ``config``.

Integrity: ``checksum`` is a SHA-256 over everything else in the file (every tensor's dtype,
shape and bytes, every key and plain value, in a fixed order), computed when the file is written
and checked when it is read, so a file damaged after writing (a bad disk, a partial copy, a
stray write) is refused with an error naming it instead of being loaded. Tensors are stored on
the CPU (a checkpoint loads on any device).
"""

from __future__ import annotations

import hashlib
import logging
import pickle
import zipfile
from pathlib import Path

import torch

from fasttomo.logging import size_text

log = logging.getLogger("fasttomo.train")

FORMAT = "fasttomo-checkpoint-v2"
OLD_FORMATS = ("fasttomo-checkpoint-v1",)  # no checksum: loaded with a warning
CHECKSUM_ALGORITHM = "sha256"
_OTHER = ("resume from another checkpoint (an earlier checkpoints/step*.pt, or resume=<run folder> for the newest "
          "intact one)")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the file and the fix."""


# --------------------------------------------------------------------------------------- checksum
def _feed(h, obj) -> None:
    """Feed ``obj`` into hash ``h`` in a canonical order (dict keys sorted by their repr)."""
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            data = t.cpu().contiguous().reshape(-1)
            h.update(memoryview(data.view(torch.uint8).numpy()) if data.element_size() else b"")  # no copy
    elif isinstance(obj, dict):
        h.update(f"D{len(obj)}".encode())
        for k in sorted(obj, key=repr):
            h.update(f"K{k!r}".encode())
            _feed(h, obj[k])
    elif isinstance(obj, (list, tuple)):  # a tuple may come back as a list: hash both alike
        h.update(f"L{len(obj)}".encode())
        for v in obj:
            _feed(h, v)
    elif obj is None or isinstance(obj, (bool, int, float, str)):
        h.update(f"P{type(obj).__name__}:{obj!r}".encode())
    else:  # anything else is refused on load anyway; hash its repr so saving never fails here
        h.update(f"O{type(obj).__name__}:{obj!r}".encode())


def checksum(state: dict) -> str:
    """SHA-256 hex digest of a checkpoint's contents (everything but the ``checksum`` entry)."""
    h = hashlib.sha256()
    _feed(h, {k: v for k, v in state.items() if k != "checksum"})
    return h.hexdigest()


def _to_cpu(obj, copy: bool = False):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {k: _to_cpu(v, copy) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v, copy) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v, copy) for v in obj)
    return obj


def host_copy(state: dict) -> dict:
    """``state`` with every tensor copied to the host (a copy also of host tensors): what a
    checkpoint written on another thread saves, whatever the run does to its tensors meanwhile."""
    return _to_cpu(state, copy=True)


# --------------------------------------------------------------------------------------- save / load
def save_checkpoint(path: str | Path, state: dict) -> Path:
    """Write ``state`` (plus the format tag and its checksum; tensors moved to the CPU)
    atomically to ``path`` (an existing file is replaced: checkpoints of one run supersede each
    other)."""
    from fasttomo.data.io.atomic import atomic_write

    path = Path(path)
    payload = {"format": FORMAT, **_to_cpu(state)}
    payload["checksum"] = {"algorithm": CHECKSUM_ALGORITHM, "digest": checksum(payload)}
    atomic_write(path, lambda tmp: torch.save(payload, tmp), overwrite=True)
    step = state.get("step")
    log.info("wrote checkpoint %s%s (%s)", path, f" at step {step}" if isinstance(step, int) else "",
             size_text(path.stat().st_size))
    return path


def _unpickling_detail(exc: BaseException) -> str:
    """What torch's weights_only unpickler objected to, without its advice to load unsafely."""
    text = str(exc).replace("WeightsUnpickler error:", "\n\n")
    advice = ("weights_only", "Weights only load failed", "Check the documentation", "Please file an issue")
    for para in text.split("\n\n"):
        para = " ".join(para.split())
        if para and not any(a in para for a in advice):
            return para[:200]
    return "the unpickler refused its contents"


def _data_file_kind(path: Path) -> str | None:
    """'a volume or tilt series (MRC)' (HDF5, TIFF) for a file whose first bytes say so, else None."""
    with open(path, "rb") as f:
        head = f.read(1024)
    if head.startswith(b"\x89HDF\r\n\x1a\n"):
        return "an HDF5 file (a volume or tilt series)"
    if head[:4] in (b"II*\x00", b"MM\x00*"):
        return "a TIFF file (a volume or tilt series)"
    if len(head) >= 212 and head[208:211] == b"MAP":
        return "a volume or tilt series (MRC)"
    return None


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", *, verify: bool = True) -> dict:
    """Read a fasttomo checkpoint with ``torch.load(weights_only=True)``: tensors, numbers,
    strings, lists and dicts only. Anything else (a pickled class instance, a function, ...) is
    refused with :class:`CheckpointError`, and so is a file whose contents do not match their
    checksum (``verify``). Load to the CPU (the default): modules and optimizers copy their state
    to the right device, and RNG states must stay CPU byte tensors."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint {path} does not exist; give resume=<path to a .pt written by fasttomo> "
                              "or resume=<run folder>.")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: the file is empty (0 bytes); {_OTHER}.")
    if not zipfile.is_zipfile(path):
        kind = _data_file_kind(path)
        if kind:  # resume=<run>/volume.mrc: a result of the run, not its checkpoint
            raise CheckpointError(f"resume={path}: this is {kind}, not a checkpoint; give the run folder "
                                  f"(resume={path.parent}) or its checkpoints/last.pt.")
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt: it is not a PyTorch checkpoint archive "
                              f"({size} bytes); {_OTHER}.")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = _unpickling_detail(exc)
        if "global" in detail.lower():
            raise CheckpointError(
                f"checkpoint {path} holds objects other than tensors and plain values and was refused ({detail}). "
                "Only load checkpoints written by fasttomo.") from None
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({detail}); {_OTHER}.") from None
    except (RuntimeError, EOFError, ValueError, OSError, KeyError, IndexError) as exc:
        detail = " ".join(str(exc).split())[:160] or type(exc).__name__
        raise CheckpointError(f"checkpoint {path} is truncated or corrupt ({detail}); {_OTHER}.") from None
    fmt = state.get("format") if isinstance(state, dict) else None
    if fmt not in (FORMAT, *OLD_FORMATS):
        raise CheckpointError(f"checkpoint {path} is not a {FORMAT} file; was it written by fasttomo?")
    if fmt == FORMAT:
        stored = state.get("checksum")
        if not (isinstance(stored, dict) and isinstance(stored.get("digest"), str)):
            raise CheckpointError(f"checkpoint {path} is corrupt: its checksum entry is missing or damaged; {_OTHER}.")
        if verify and checksum(state) != stored["digest"]:
            raise CheckpointError(
                f"checkpoint {path} is corrupt: its contents do not match the checksum written with them (the file "
                f"was damaged or changed after it was written); {_OTHER}.")
    else:
        log.warning("checkpoint %s has no checksum (written by an older fasttomo); its contents cannot be verified.",
                    path)
    return state


def read_config(path: str | Path) -> dict | None:
    """The resolved config stored in checkpoint ``path`` (verified like :func:`load_checkpoint`);
    None for a checkpoint without one."""
    cfg = load_checkpoint(path).get("config")
    return cfg if isinstance(cfg, dict) else None


def find_checkpoint(path: str | Path) -> Path:
    """``path`` itself when it is a file; for a run folder (or its ``checkpoints/`` folder) the
    newest intact checkpoint in it (newest by modification time; damaged ones are skipped with a
    warning). Raises :class:`CheckpointError` naming the folder when it holds none."""
    path = Path(path)
    if not path.is_dir():
        return path
    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    candidates = sorted((p for p in folder.glob("*.pt") if p.is_file()), key=lambda p: p.stat().st_mtime_ns,
                        reverse=True)
    if not candidates:
        raise CheckpointError(f"resume={path}: no checkpoint (*.pt) in {folder}; give a checkpoint file, or start "
                              "a new run without resume.")
    problems = []
    for cand in candidates:
        try:
            load_checkpoint(cand)
        except CheckpointError as exc:
            problems.append(str(exc))
            log.warning("skipping %s", exc)
            continue
        return cand
    raise CheckpointError(f"resume={path}: none of the {len(candidates)} checkpoints in {folder} is intact "
                          f"(first: {problems[0]}).")


def load_optimizer_state(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """``optimizer.load_state_dict(state)`` that keeps this optimizer's implementation switches
    (fused, foreach, capturable, differentiable): torch copies them from the saved param groups,
    which would e.g. turn a fused optimizer into a for-each one when the checkpoint came from
    another build."""
    keys = ("fused", "foreach", "capturable", "differentiable")
    impl = [{k: g[k] for k in keys if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, keep in zip(optimizer.param_groups, impl):
        group.update(keep)
    for group in optimizer.param_groups:  # fused/capturable keep `step` on the parameter's device
        if group.get("fused") or group.get("capturable"):
            for p in group["params"]:
                st = optimizer.state.get(p, {})
                step = st.get("step")
                if torch.is_tensor(step) and step.device != p.device:
                    st["step"] = step.to(device=p.device, dtype=torch.float32)
                elif step is not None and not torch.is_tensor(step):
                    st["step"] = torch.tensor(float(step), device=p.device, dtype=torch.float32)


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


# --------------------------------------------------------------------------------------- parts
class PortableOptimizer:
    """An optimizer as a checkpoint part: learning rates saved as plain floats (a captured step
    keeps them in device tensors, so a checkpoint resumes with or without CUDA graphs) and loaded
    with :func:`load_optimizer_state` (this optimizer's implementation switches are kept)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def state_dict(self) -> dict:
        state = self.optimizer.state_dict()
        for group in state["param_groups"]:
            if torch.is_tensor(group["lr"]):
                group["lr"] = float(group["lr"])
        return state

    def load_state_dict(self, state: dict) -> None:
        load_optimizer_state(self.optimizer, state)


class RankRNG:
    """The RNG streams of every rank as a checkpoint part: ``state_dict`` gathers each rank's
    :func:`rng_state` (collective under DDP), ``load_state_dict`` takes this rank's."""

    def __init__(self, device: torch.device, reg_generator: torch.Generator | None, rank: int = 0):
        self.device, self.reg_generator, self.rank = device, reg_generator, rank

    def state_dict(self) -> dict:
        from fasttomo.train.distributed import all_gather_object

        return {"ranks": all_gather_object(rng_state(self.device, self.reg_generator))}

    def load_state_dict(self, state: dict) -> None:
        set_rng_state(state["ranks"][self.rank], self.device, self.reg_generator)


class Checkpointer:
    """Saves and restores named parts -- anything with ``state_dict()`` / ``load_state_dict()``
    (the projector, the optimizer through :class:`PortableOptimizer`, the sampler, the grad
    scaler, the plateau state, the guard, the RNG streams through :class:`RankRNG`) -- as one
    checkpoint dict, each part under its name. ``optional`` parts may be absent (None) here or in
    the file (an older checkpoint); a required part missing from the file, or one that does not
    fit, is a :class:`CheckpointError` naming the part and the fix. ``extra`` holds plain values
    stored beside the parts (the run's resolved config)."""

    def __init__(self, parts: dict[str, object | None], optional: tuple[str, ...] = (), extra: dict | None = None):
        self.parts = dict(parts)
        self.optional = tuple(optional)
        self.extra = dict(extra or {})

    def state_dict(self) -> dict:
        out = {name: (None if part is None else part.state_dict()) for name, part in self.parts.items()}
        out.update(self.extra)
        return out

    def load_state_dict(self, state: dict, source: str = "checkpoint") -> None:
        for name, part in self.parts.items():
            saved = state.get(name)
            if part is None or (saved is None and name in self.optional):
                continue
            if saved is None:
                raise CheckpointError(f"{source} holds no {name!r} state; {_OTHER}.")
            try:
                part.load_state_dict(saved)
            except (RuntimeError, ValueError, KeyError, IndexError) as exc:
                raise CheckpointError(
                    f"{source} does not fit this run ({name}: {str(exc).splitlines()[0]}); resume with the model, pose, "
                    "optimizer, sampler and data settings of the saved run.") from exc

    def save(self, path: str | Path, state: dict | None = None) -> Path:
        """Write :meth:`state_dict` (or ``state``) to ``path`` atomically, with its checksum."""
        return save_checkpoint(path, self.state_dict() if state is None else state)


__all__ = ["FORMAT", "CheckpointError", "Checkpointer", "PortableOptimizer", "RankRNG", "save_checkpoint",
           "load_checkpoint", "read_config", "find_checkpoint", "load_optimizer_state", "checksum", "rng_state",
           "set_rng_state"]
