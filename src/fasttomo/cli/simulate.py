"""`fasttomo-simulate`: write the built-in synthetic tilt series and its ground truth to files.

    fasttomo-simulate out=phantom format=mrc data.width=96 data.noise=0.05
        -> phantom.mrc (stack), phantom.rawtlt (angles, degrees), phantom_truth.mrc (volume)
    fasttomo-simulate out=phantom format=h5
        -> phantom.h5 (fasttomo's HDF5 layout: stack, angles and ground truth)
    fasttomo-simulate out=mis data.phantom=ellipsoids data.pose_error_shift=3 data.pose_error_rotation=1
        -> also mis_poses.json: the true per-view poses of the misaligned views (both formats;
           format in fasttomo.data.io.poses), written only when the views were posed
    fasttomo-simulate out=np data.phantom=nanoparticle data.particle.species=2
        -> also np_atoms.csv: the true atoms in the frame of fasttomo-trace's atoms.csv, described
           by np_atoms.json (both formats)

Feed them back with ``fasttomo-reconstruct data=mrc data.path=phantom.mrc data.angles=phantom.rawtlt``.
No existing file is ever replaced unless overwrite=true.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from pathlib import Path

import numpy as np

from fasttomo.config import ConfigError, DataConfig, from_dict, hydra_schema, strip_unset

log = logging.getLogger("fasttomo")


@dataclasses.dataclass
class SimulateConfig:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    out: str = "phantom"
    """Output base path, a file name (a suffix .mrc or .h5 that matches format is dropped; a folder
    is refused): <out>.mrc + <out>.rawtlt + <out>_truth.mrc, or <out>.h5; plus
    <out>_poses.json (the true poses) when data.pose_error_shift, pose_error_rotation or
    tilt_axis_error is not 0, and
    <out>_atoms.csv (the true atoms) and <out>_atoms.json (its description) with
    data.phantom=nanoparticle."""
    format: str = "mrc"
    """mrc or h5."""
    overwrite: bool = False
    """Replace existing files (otherwise an existing file is an error)."""
    truth: bool = True
    """Write the ground-truth volume (false: the stack and angles alone, e.g. for a camera-sized
    box: 4096^2 x 256 voxels are 17 GB)."""
    device: str = "auto"
    """Where the ellipsoid specimens are projected and voxelized: auto (the GPU when there is one),
    cpu, or a torch device such as cuda:1. The values are the same bit for bit on each."""


def simulate_device(device: str) -> str | None:
    """The torch device of ``device`` (auto, cpu, cuda, cuda:N), None for numpy on the CPU."""
    if device == "cpu":
        return None
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else None
    if not device.startswith("cuda"):
        raise ConfigError(f"device: must be auto, cpu, cuda or cuda:N, got {device!r}.")
    if not torch.cuda.is_available():
        raise ConfigError(f"device={device}: this machine has no CUDA GPU; use device=cpu (or auto).")
    return device


SUFFIXES = {".mrc": "mrc", ".h5": "h5", ".hdf5": "h5"}


def out_base(out: str, fmt: str) -> Path:
    """The base path of every file from ``out=``: a folder is refused (its files would land beside
    it, as <folder>.mrc); the suffix of ``format`` is dropped (out=b.mrc: b.mrc, b.rawtlt,
    b_truth.mrc, not b.mrc_truth.mrc); another format's suffix is an error."""
    path = Path(out)
    if not out.strip() or out.endswith(("/", os.sep)) or path.is_dir():
        example = path / "phantom" if out.strip() else Path("phantom")
        raise ConfigError(f"out={out}: {'a folder' if out.strip() else 'empty'}; out= is a file name without suffix, "
                          f"e.g. out={example} (writes {example}.{fmt} and its companions).")
    said = SUFFIXES.get(path.suffix.lower())
    if said is not None and said != fmt:
        raise ConfigError(f"out={out}: the suffix {path.suffix} says format={said}, but format={fmt}; write "
                          f"out={path.with_suffix('')} format={said}, or out={path.with_suffix('')} for format={fmt}.")
    return path.with_suffix("") if said else path


def simulate(data_cfg: DataConfig, out: str, fmt: str, overwrite: bool = False, truth: bool = True,
             device: str = "auto") -> list[Path]:
    """Write the phantom tilt series (and ground truth, and the true poses of misaligned views);
    returns the written paths."""
    from fasttomo.data.io import OutputExistsError, write_tiltseries
    from fasttomo.data.io.poses import poses_path, write_poses_json
    from fasttomo.data.io.volume import write_volume
    from fasttomo.data.phantom import make_tiltseries
    from fasttomo.trace.files import meta_path

    if fmt not in ("mrc", "h5"):
        raise ConfigError(f"format: must be mrc or h5, got {fmt!r}.")
    if data_cfg.source != "phantom":
        raise ConfigError("data.source: fasttomo-simulate only writes the built-in phantom (data=phantom).")
    base = out_base(out, fmt)
    stack = base.parent / f"{base.name}.{fmt}"  # not with_suffix: out=run.v2 keeps its .v2, as the other names do
    ts = make_tiltseries(data_cfg, simulate_device(device), truth)
    true_poses = ts.metadata.get("true_poses")
    true_atoms = ts.metadata.get("true_atoms")
    pose_file = Path(poses_path(base))
    targets = [stack]
    if fmt == "mrc":
        targets += [base.parent / f"{base.name}.rawtlt", *([base.parent / f"{base.name}_truth.mrc"] if truth else [])]
    if true_poses is not None:
        targets.append(pose_file)
    atoms_file = base.parent / f"{base.name}_atoms.csv"
    if true_atoms is not None:
        targets += [atoms_file, meta_path(atoms_file)]
    existing = [t for t in targets if t.exists()]
    if existing and not overwrite:
        # checked first, so a refused run writes nothing (no new stack beside an old poses or atoms file)
        names = ", ".join(str(t) for t in existing)
        raise OutputExistsError(f"{names}: {'file already exists' if len(existing) == 1 else 'files already exist'}; "
                                "refusing to overwrite. Choose another out= name, or set overwrite=true to replace "
                                f"{'it' if len(existing) == 1 else 'them'}.")
    stack_ts = ts
    if fmt == "mrc":  # the ground truth goes to its own file below, not into the stack's MRC
        stack_ts = dataclasses.replace(ts, ground_truth=None)
    try:
        written = write_tiltseries(stack, stack_ts, fmt, overwrite=overwrite)
        paths = [Path(p) for p in written] if isinstance(written, (list, tuple)) else [Path(written)]
        if fmt == "mrc" and ts.ground_truth is not None:
            truth = base.parent / f"{base.name}_truth.mrc"
            write_volume(truth, ts.ground_truth, ts.pixel_size, label="fasttomo phantom ground truth",
                         attrs={"source": "fasttomo-simulate"}, fmt="mrc", overwrite=overwrite)
            paths.append(truth)
    except OutputExistsError as exc:  # the writers name reconstruct's key; here it is overwrite=true
        raise OutputExistsError(str(exc).replace("Choose another output folder or file name, or set "
                                                 "output.overwrite=true", "Choose another out= name, or set "
                                                 "overwrite=true")) from None
    if true_poses is not None:
        meta = ts.metadata
        source = {"made_by": "fasttomo-simulate", "pose_error_shift_px": meta["pose_error_shift_px"],
                  "pose_error_rotation_deg": meta["pose_error_rotation_deg"],
                  "tilt_axis_error_deg": meta["tilt_axis_error_deg"], "phantom_seed": meta["phantom_seed"],
                  "phantom": meta["phantom_kind"], "stack": str(stack)}
        paths.append(Path(write_poses_json(pose_file, true_poses, source=source, overwrite=overwrite)))
    if true_atoms is not None:
        from fasttomo.trace.files import write_atoms_csv

        n = len(true_atoms["species"])
        meta = {"made_by": "fasttomo-simulate", "what": f"true atoms of {ts.metadata['phantom']['name']}",
                "frame": "Angstrom; origin at the centre of the first voxel; x = columns (X), y = rows (Y), "
                         "z = sections (Z), as fasttomo-trace's atoms.csv",
                "voxel_size_A": float(ts.pixel_size), "intensity": "integrated density", "fit_error": "0",
                "stack": str(stack)}
        paths += [Path(p) for p in write_atoms_csv(atoms_file, true_atoms["xyz_A"], true_atoms["intensity"],
                                                   np.zeros(n), true_atoms["species"], meta=meta, overwrite=overwrite)]
    for p in paths:
        log.info("wrote %s", p)
    return paths


DESCRIPTION = """write the built-in synthetic tilt series (fasttomo's phantom, projected with exact
analytic line integrals) and its ground truth to files, to inspect them or to feed them back to
fasttomo-reconstruct as if they were measured: <out>.mrc + <out>.rawtlt + <out>_truth.mrc
(format=mrc) or <out>.h5 (format=h5, all in one file), plus <out>_poses.json, the true poses, when
the views are misaligned (data.pose_error_shift / pose_error_rotation / tilt_axis_error). Existing files are
never replaced unless overwrite=true.

Every data.* key of the phantom works here as in fasttomo-reconstruct (--help data lists them)."""


def program():
    """What ``--help`` and the command-line checks know of this command (fasttomo.cli.help)."""
    from fasttomo.cli.help import Program
    from fasttomo.config import config_dir

    return Program("fasttomo-simulate", DESCRIPTION, SimulateConfig, config_dir(), "simulate",
                   ("out", "format", "overwrite", "data.width", "data.height", "data.n_tilts", "data.noise",
                    "data.phantom", "data.pose_error_shift", "data.pose_error_rotation", "data.phantom_seed"),
                   examples=("fasttomo-simulate out=phantom format=mrc data.width=96 data.noise=0.05",
                             "fasttomo-simulate out=mis data.phantom=ellipsoids data.pose_error_shift=3 "
                             "data.pose_error_rotation=1",
                             "fasttomo-reconstruct data=mrc data.path=phantom.mrc data.angles=phantom.rawtlt"),
                   groups=())


def _start() -> None:
    """Compose configs/simulate.yaml with the command line (Hydra) and write the files."""
    from fasttomo.cli.errors import hydra_app
    from fasttomo.data.specimen import PhantomError
    from fasttomo.data.tiltseries import TiltSeriesError

    def run(data: dict) -> None:
        sim = from_dict(SimulateConfig, strip_unset(data))
        simulate(sim.data, sim.out, sim.format, sim.overwrite, sim.truth, sim.device)

    hydra_app("simulate", hydra_schema(SimulateConfig), run,
              (ConfigError, TiltSeriesError, PhantomError, FileExistsError))


def main() -> None:
    from fasttomo.cli.errors import run_checked

    run_checked(program(), sys.argv[1:], _start)


if __name__ == "__main__":
    main()
