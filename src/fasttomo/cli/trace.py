"""`fasttomo-trace`: trace the atoms of a volume (and score them against true coordinates).

    fasttomo-trace volume=run/volume.mrc
    fasttomo-trace volume=run/volume.mrc classes=2 elements=[Pd,Pt] truth=np_atoms.csv
    fasttomo-trace volume=vol.h5 voxel_size=0.5 hydra.run.dir=outputs/trace1

The run folder (``hydra.run.dir``, default ``outputs/trace/<date>/<time>``) follows
fasttomo-reconstruct's rules (fasttomo.run.folder): one run at a time, a manifest of what the run
writes, and a folder holding results of an earlier run is refused unless ``output.overwrite=true``.
It receives atoms.csv (plain CSV) with atoms.json (what the file holds: the volume, the voxel size,
the frame), atoms.xyz, slabs.png, metrics.json, config.yaml and trace.log.

Exit codes: 0 done; 2 config, input file or output folder problem (one line); 1 an unexpected
error (traceback).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from fasttomo.config import ConfigError, _require, tool_device

log = logging.getLogger("fasttomo")

OUTPUTS = ["trace.log", "config.yaml", "atoms.csv", "atoms.json", "atoms.xyz", "slabs.png", "metrics.json"]
FRAME = ("Angstrom; origin at the centre of the first voxel; x = columns (X), y = rows (Y), z = sections (Z), "
         "as volume.mrc")


ELEMENTS = frozenset("""H He Li Be B C N O F Ne Na Mg Al Si P S Cl Ar K Ca Sc Ti V Cr Mn Fe Co Ni Cu Zn Ga Ge As Se
Br Kr Rb Sr Y Zr Nb Mo Tc Ru Rh Pd Ag Cd In Sn Sb Te I Xe Cs Ba La Ce Pr Nd Pm Sm Eu Gd Tb Dy Ho Er Tm Yb Lu Hf Ta W
Re Os Ir Pt Au Hg Tl Pb Bi Po At Rn Fr Ra Ac Th Pa U Np Pu Am Cm Bk Cf Es Fm Md No Lr Rf Db Sg Bh Hs Mt Ds Rg Cn Nh Fl
Mc Lv Ts Og X""".split())
"""The element symbols atoms.xyz may carry (X: a species without one)."""


@dataclasses.dataclass
class TraceOutputConfig:
    dir: Optional[str] = None
    """Run folder; None: Hydra's run dir (hydra.run.dir, default outputs/trace/<date>/<time>)."""
    overwrite: bool = False
    """Replace the results of an earlier trace in the folder (its files are removed first)."""


@dataclasses.dataclass
class TraceConfig:
    volume: Optional[str] = None
    """The volume to trace (.mrc/.rec/.map with its voxel size, .h5, .tif), an array (Z, Y, X);
    atoms are bright (positive density)."""
    voxel_size: Optional[float] = None
    """Voxel size in Angstrom; overrides the file's header (needed when the file has none)."""
    truth: Optional[str] = None
    """True coordinates (atoms.csv format, e.g. fasttomo-simulate's <out>_atoms.csv): score the
    trace (precision, recall, RMSD, species accuracy) into metrics.json."""
    min_separation: float = 2.0
    """Angstrom: atoms closer than this are duplicates (the stronger is kept). Keep it below the
    shortest true interatomic distance (2.0 A suits metals, whose bonds are 2.5 A and longer)."""
    threshold: float = 0.1
    """Candidate peaks must exceed this fraction of the smoothed volume's maximum."""
    threshold_abs: Optional[float] = None
    """Candidate threshold in the volume's own units (replaces ``threshold``)."""
    smooth: float = 0.5
    """Voxels: sigma of the Gaussian smoothing before the peak search (0: none); the fit always
    uses the unsmoothed volume."""
    fit_radius: int = 2
    """Voxels: each atom is fitted on the (2 r + 1)^3 voxels around it."""
    fit_iterations: int = 15
    """Levenberg-Marquardt iterations of the first fit (half as many in each refinement round)."""
    refine_rounds: int = 3
    """Rounds of refitting every atom with its fitted neighbours subtracted (0: independent fits)."""
    sigma_range: list = dataclasses.field(default_factory=lambda: [0.3, 4.0])
    """[min, max] voxels: a fitted Gaussian width outside them rejects the candidate."""
    max_fit_error: float = 0.75
    """Reject candidates whose RMS fit residual exceeds this fraction of their fitted amplitude.
    0.75: at 0.5, 87 of 10,005 weak atoms 3.5 voxels from twice-as-dense neighbours were rejected
    in a clean rendered volume (what the subtracted neighbour leaves is large next to a weak
    atom's amplitude); noise maxima are rejected by min_snr, not by this."""
    min_intensity: float = 0.15
    """Reject candidates whose integrated intensity is below this fraction of the 90th percentile
    of all candidates' (0: keep all)."""
    min_snr: float = 4.5
    """Reject candidates whose smoothed peak is below this many noise standard deviations of the
    smoothed volume (the noise estimated from what the fitted candidates leave unexplained)."""
    screen: float = 0.75
    """Before fitting, drop candidates whose smoothed peak is below screen x min_snr times an
    upper bound of the noise (the volume's robust spread): a noise maximum then costs no fit. An
    atom the final min_snr test keeps is lost only if the true noise is below screen x that bound
    (0: no screen, every candidate is fitted)."""
    residual_rounds: int = 1
    """Rounds of searching what the fitted atoms leave unexplained for atoms hidden on a stronger
    neighbour's shoulder (0: none)."""
    classes: int = 1
    """Species classes by k-means on the integrated intensity (1: no classification); species
    are numbered 1 (weakest) .. classes."""
    elements: list = dataclasses.field(default_factory=list)
    """Element symbols of species 1 .. classes for atoms.xyz (e.g. [Pd, Pt]); empty: X (a
    placeholder ASE and OVITO accept)."""
    match_radius: Optional[float] = None
    """Angstrom: a traced and a true atom match when closer than this; None: half the median
    nearest-neighbour distance of the true atoms."""
    slab: Optional[float] = None
    """Angstrom: half thickness of the slabs drawn in slabs.png; None: min_separation / 2."""
    device: str = "auto"
    """auto (the first GPU if torch sees one), cpu, cuda or cuda:N."""
    name: str = "trace"
    """A label written into the outputs."""
    output: TraceOutputConfig = dataclasses.field(default_factory=TraceOutputConfig)

    def __post_init__(self) -> None:
        def pos(name, v):
            _require(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0, name,
                     f"must be a positive number, got {v!r}.")
        pos("min_separation", self.min_separation)
        for name in ("voxel_size", "match_radius", "slab"):
            if getattr(self, name) is not None:
                pos(name, getattr(self, name))
        _require(isinstance(self.threshold, (int, float)) and 0 <= self.threshold < 1, "threshold",
                 f"is a fraction of the smoothed maximum and must be in [0, 1), got {self.threshold!r}.")
        if self.threshold_abs is not None:
            _require(isinstance(self.threshold_abs, (int, float)) and math.isfinite(self.threshold_abs),
                     "threshold_abs", f"must be a finite number, got {self.threshold_abs!r}.")
        _require(isinstance(self.smooth, (int, float)) and 0 <= self.smooth <= 5, "smooth",
                 f"must be between 0 and 5 voxels, got {self.smooth!r}.")
        for name, lo, hi in (("fit_radius", 1, 6), ("fit_iterations", 1, 200), ("refine_rounds", 0, 20),
                             ("residual_rounds", 0, 10), ("classes", 1, 16)):
            v = getattr(self, name)
            _require(isinstance(v, int) and not isinstance(v, bool) and lo <= v <= hi, name,
                     f"must be an integer in [{lo}, {hi}], got {v!r}.")
        sr = self.sigma_range
        _require(len(sr) == 2 and all(isinstance(v, (int, float)) and v > 0 for v in sr) and sr[0] < sr[1],
                 "sigma_range", f"must be [min, max] voxels with 0 < min < max, got {sr!r}.")
        _require(isinstance(self.max_fit_error, (int, float)) and self.max_fit_error > 0, "max_fit_error",
                 f"must be > 0, got {self.max_fit_error!r}.")
        _require(isinstance(self.min_intensity, (int, float)) and 0 <= self.min_intensity < 1, "min_intensity",
                 f"must be in [0, 1), got {self.min_intensity!r}.")
        _require(isinstance(self.min_snr, (int, float)) and 0 <= self.min_snr < 100, "min_snr",
                 f"must be a number of standard deviations in [0, 100), got {self.min_snr!r}.")
        _require(isinstance(self.screen, (int, float)) and not isinstance(self.screen, bool) and 0 <= self.screen <= 1,
                 "screen", f"must be a fraction in [0, 1] (0: no screen), got {self.screen!r}.")
        _require(all(isinstance(e, str) and e.strip() and " " not in e for e in self.elements), "elements",
                 f"must be element symbols without spaces, got {self.elements!r}.")
        wrong = [e for e in self.elements if e not in ELEMENTS]
        fixes = [f"{e.capitalize()} for {e}" for e in wrong if e.capitalize() in ELEMENTS]
        _require(not wrong, "elements", f"{', '.join(wrong)}: not element symbols as the periodic table writes them "
                 "(atoms.xyz readers such as ASE and OVITO need them so: Pd, Pt, Au)"
                 + (f"; write {', '.join(fixes)}." if fixes else "."))
        _require(not self.elements or len(self.elements) == self.classes, "elements",
                 f"names {len(self.elements)} element(s) but classes={self.classes}; give one symbol per class "
                 "(e.g. classes=2 elements=[Pd,Pt]) or none.")
        _require(self.device in ("auto", "cpu", "cuda") or str(self.device).startswith("cuda:"), "device",
                 f"must be auto, cpu, cuda or cuda:N, got {self.device!r}.")

    def params(self):
        from fasttomo.trace.core import TraceParams

        return TraceParams(min_separation_A=float(self.min_separation), threshold=float(self.threshold),
                           threshold_abs=None if self.threshold_abs is None else float(self.threshold_abs),
                           smooth=float(self.smooth), fit_radius=self.fit_radius, fit_iterations=self.fit_iterations,
                           refine_rounds=self.refine_rounds, sigma_range=tuple(float(v) for v in self.sigma_range),
                           max_fit_error=float(self.max_fit_error), min_intensity=float(self.min_intensity),
                           min_snr=float(self.min_snr), screen=float(self.screen), residual_rounds=self.residual_rounds, classes=self.classes)


def _checked_inputs(cfg: TraceConfig):
    """The device and the true atoms (None without ``truth``); every input problem is raised here,
    before any work, as a :class:`ConfigError` or an ``AtomsFileError``."""
    from fasttomo.trace.files import read_atoms_csv

    if not cfg.volume:
        raise ConfigError("volume: give the volume to trace, e.g. fasttomo-trace volume=run/volume.mrc.")
    if not os.path.isfile(cfg.volume):
        raise ConfigError(f"volume={cfg.volume}: file not found; check the path.")
    if cfg.truth and not os.path.isfile(cfg.truth):
        raise ConfigError(f"truth={cfg.truth}: file not found; give the true coordinates (atoms.csv format, e.g. "
                          "fasttomo-simulate's <out>_atoms.csv).")
    if not cfg.output.dir:
        raise ConfigError("output.dir: no run folder; set hydra.run.dir=<folder> or output.dir=<folder>.")
    dev = tool_device(cfg.device, ConfigError)
    return dev, (read_atoms_csv(cfg.truth) if cfg.truth else None)


def _read(cfg: TraceConfig):
    """The volume, its voxel size in Angstrom and where that size comes from."""
    from fasttomo.data.io.volume import read_volume

    vol, vx, attrs = read_volume(cfg.volume, key="volume")
    source = "the header of " + str(cfg.volume)
    if cfg.voxel_size is not None:
        vx, source = float(cfg.voxel_size), "voxel_size="
    elif attrs.get("voxel_size_assumed"):
        source = "assumed (none in the file): set voxel_size=<A>"
    log.info("volume %s: (Z, Y, X) = %s, voxel %.4g A (%s)", cfg.volume, vol.shape, vx, source)
    return vol, vx, source


def _write_atoms(out_dir: Path, cfg: TraceConfig, vol: np.ndarray, vx: float, res) -> None:
    """atoms.csv with atoms.json, atoms.xyz and slabs.png."""
    from fasttomo import __version__
    from fasttomo.trace.files import slabs_png, write_atoms_csv, write_xyz

    meta = {"made_by": f"fasttomo-trace {__version__}", "volume": str(cfg.volume), "frame": FRAME,
            "voxel_size_A": vx, "name": cfg.name}
    write_atoms_csv(out_dir / "atoms.csv", res.xyz_A, res.intensity, res.fit_error, res.species, meta=meta,
                    overwrite=True)
    symbols = list(cfg.elements) or ["X"] * cfg.classes
    box = np.array(vol.shape[::-1], dtype=np.float64) * vx
    write_xyz(out_dir / "atoms.xyz", res.xyz_A, res.species, symbols, res.intensity, res.fit_error, box, vx,
              overwrite=True)
    half = (cfg.slab if cfg.slab is not None else cfg.min_separation / 2.0) / vx
    slabs_png(out_dir / "slabs.png", vol, res.zyx, res.species, half, voxel_size_A=vx, overwrite=True)


def _score(cfg: TraceConfig, res, truth: dict, vx: float) -> dict:
    """The trace scored against the true atoms (metrics.json's ``truth``)."""
    from fasttomo.trace.score import score_trace

    sc = score_trace(res.xyz_A, truth["xyz_A"], voxel_size_A=vx, traced_species=res.species if cfg.classes > 1
                     else None, true_species=truth["species"], match_radius_A=cfg.match_radius)
    acc = sc.get("species_accuracy")
    log.info("vs truth %s: precision %.4f, recall %.4f (%d of %d true atoms within %.3g A), RMSD %.4g A = %.4g "
             "voxel%s", cfg.truth, sc["precision"], sc["recall"], sc["n_matched"], sc["n_true"],
             sc["match_radius_A"], sc["rmsd_A"], sc["rmsd_voxels"], "" if acc is None else f", species accuracy {acc:.4f}")
    return {"path": str(cfg.truth), **sc}


def _trace_into(out_dir: Path, cfg: TraceConfig, dev, truth: dict | None) -> dict:
    """Read, trace, write every result into the open run folder ``out_dir``; returns metrics."""
    import yaml

    from fasttomo import __version__
    from fasttomo.config import to_dict
    from fasttomo.data.io.atomic import atomic_write
    from fasttomo.run.outputs import dumps
    from fasttomo.trace.core import trace_volume

    t0 = time.perf_counter()
    vol, vx, source = _read(cfg)
    t_read = time.perf_counter() - t0
    (out_dir / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False), encoding="utf-8")
    res = trace_volume(vol, vx, cfg.params(), device=dev)
    st = res.stats
    log.info("%d atoms traced from %d candidates (rejected: %d fits, %d weak; %d duplicates merged) in %.2f s on %s",
             res.n, st["n_candidates"], st["rejected_fit"], st["rejected_weak"], st["merged_duplicates"],
             st["seconds"], st["device"])
    _write_atoms(out_dir, cfg, vol, vx, res)
    metrics = {"fasttomo_version": __version__, "name": cfg.name, "volume": str(cfg.volume),
               "shape_zyx": list(vol.shape), "voxel_size_A": vx, "voxel_size_source": source, "frame": FRAME,
               "n_atoms": res.n, "read_seconds": t_read, **{k: v for k, v in st.items() if k != "n_atoms"}}
    if res.n:
        metrics["intensity_median"] = float(np.median(res.intensity))
    if truth is not None:
        metrics["truth"] = _score(cfg, res, truth, vx)
    atomic_write(out_dir / "metrics.json", lambda tmp: Path(tmp).write_text(dumps(metrics), encoding="utf-8"),
                 overwrite=True)
    return metrics


def summary_lines(out_dir: Path, m: dict) -> list[str]:
    """The closing summary, in fasttomo-reconstruct's style: the run folder, its files with their
    sizes, what was traced in how long, the quality against the truth, what to look at."""
    from fasttomo.logging import duration_text, size_text

    files = sorted((p.name, p.stat().st_size) for p in out_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    w = max((len(n) for n, _ in files), default=0)
    lines = [f"run folder: {out_dir}"] + [f"  {n.ljust(w)}  {size_text(s):>10}" for n, s in files]
    lines.append(f"{m['n_atoms']} atoms from {m['n_candidates']} candidates in {duration_text(m['seconds'])} on "
                 f"{m['device']}")
    t = m.get("truth")
    if t:
        acc = t.get("species_accuracy")
        lines.append(f"quality: precision {t['precision']:.4f}, recall {t['recall']:.4f}, RMSD {t['rmsd_A']:.4g} A"
                     + ("" if acc is None else f", species accuracy {acc:.4f}"))
    else:
        lines.append("quality: no true atoms (truth=<atoms.csv> scores the trace)")
    lines.append(f"look at it: {out_dir / 'slabs.png'}")
    return lines


def run_trace(cfg: TraceConfig) -> dict:
    """Trace ``cfg.volume`` into ``cfg.output.dir`` (which must be set); returns metrics."""
    from fasttomo.logging import add_file_log
    from fasttomo.run.folder import RunFolder

    dev, truth = _checked_inputs(cfg)  # a bad truth file is said before any work
    out_dir = Path(cfg.output.dir)
    folder = RunFolder(out_dir, overwrite=cfg.output.overwrite, outputs=OUTPUTS).open()
    handler = None
    try:
        handler = add_file_log(out_dir / "trace.log", overwrite=True)
        for note in folder.notes:
            log.info("%s", note)
        metrics = _trace_into(out_dir, cfg, dev, truth)
        folder.finish("finished")
        log.info("finished.\n%s", "\n".join(summary_lines(out_dir, metrics)))
        return metrics
    except BaseException as exc:
        folder.finish("failed", error=" ".join(str(exc).split())[:300] or type(exc).__name__)
        raise
    finally:
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()


def _prune_new_empty(folder: str, started: float) -> None:
    """Remove ``folder`` and its parents while empty and made after ``started`` (a run folder
    Hydra created for a run that wrote nothing)."""
    p = Path(folder).resolve()
    stop = Path.cwd().resolve()
    while p != stop and p != p.parent and stop in p.parents:
        try:
            if not p.is_dir() or any(p.iterdir()) or p.stat().st_ctime < started - 1:
                return
            p.rmdir()
        except OSError:
            return
        p = p.parent


DESCRIPTION = """trace the atoms of a reconstructed volume: candidate peaks of the smoothed volume,
each fitted with a 3-D Gaussian (refined with its neighbours subtracted), duplicates merged, weak and
badly fitted candidates rejected, species classified by integrated intensity; with truth= the trace
is scored against true coordinates (precision, recall, RMSD, species accuracy).

The run folder (hydra.run.dir=..., default outputs/trace/<date>/<time>) receives atoms.csv (plain
CSV, Angstrom) with atoms.json (what it holds), atoms.xyz (extended XYZ for ASE and OVITO),
slabs.png, metrics.json, config.yaml and trace.log; a folder holding an earlier trace is refused
unless output.overwrite=true."""


def program():
    """What ``--help`` and the command-line checks know of this command (fasttomo.cli.help)."""
    from fasttomo.cli.help import Program
    from fasttomo.config import config_dir

    return Program("fasttomo-trace", DESCRIPTION, TraceConfig, config_dir(), "trace",
                   ("volume", "voxel_size", "truth", "classes", "elements", "min_separation", "threshold", "min_snr",
                    "device", "output.overwrite"),
                   examples=("fasttomo-trace volume=run/volume.mrc",
                             "fasttomo-trace volume=run/volume.mrc classes=2 elements=[Pd,Pt] truth=np_atoms.csv",
                             "fasttomo-trace volume=vol.h5 voxel_size=0.5 hydra.run.dir=outputs/trace1"),
                   groups=())


def _start() -> None:
    """Compose configs/trace.yaml with the command line (Hydra) and trace."""
    import hydra
    from hydra.core.config_store import ConfigStore
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from fasttomo.config import config_dir, from_dict

    started = time.time()
    # the typed schema (first in configs/trace.yaml's defaults): a misspelled key is refused
    ConfigStore.instance().store(name="fasttomo_trace_schema", node=TraceConfig)

    @hydra.main(version_base="1.3", config_path=config_dir(), config_name="trace")
    def _app(cfg) -> None:
        from fasttomo.data.tiltseries import TiltSeriesError
        from fasttomo.run.folder import OutputExistsError, OutputFolderError
        from fasttomo.trace.core import TraceError
        from fasttomo.trace.files import AtomsFileError

        hydra_dir = HydraConfig.get().runtime.output_dir
        try:
            data = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)
            data.pop("hydra", None)
            tc = from_dict(TraceConfig, data)
            if not tc.output.dir:
                tc.output.dir = hydra_dir
            run_trace(tc)
        except (ConfigError, TiltSeriesError, TraceError, AtomsFileError, OutputExistsError, OutputFolderError,
                FileExistsError) as exc:
            _prune_new_empty(hydra_dir, started)
            log.error("%s", exc)
            sys.exit(2)
        if Path(tc.output.dir).resolve() != Path(hydra_dir).resolve():
            _prune_new_empty(hydra_dir, started)

    _app()


def main() -> None:
    from fasttomo.cli.errors import run_checked

    run_checked(program(), sys.argv[1:], _start)


if __name__ == "__main__":
    main()
