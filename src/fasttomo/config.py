"""Typed, validated configuration schemas.

The YAML files in ``configs/`` are composed by Hydra in the entry points (the only modules that
import hydra/omegaconf), turned into a plain dict and then into these dataclasses by
:func:`from_dict`, which rejects unknown keys and wrong types with an error naming the field and
the fix. Every field carries an attribute docstring; ``__post_init__`` validates ranges.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any, Optional, Union


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the field and how to fix it."""


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"{field}: {msg}")


def _positive(value: float, field: str) -> None:
    _require(isinstance(value, (int, float)) and math.isfinite(value) and value > 0, field,
             f"must be > 0, got {value!r}; set {field}=<positive number>.")


def _nonneg(value: float, field: str) -> None:
    _require(isinstance(value, (int, float)) and math.isfinite(value) and value >= 0, field,
             f"must be >= 0, got {value!r}; set {field}=<number >= 0>.")


def _choice(value: Any, choices: tuple, field: str) -> None:
    _require(value in choices, field, f"must be one of {list(choices)}, got {value!r}.")


# --------------------------------------------------------------------------------------- data
@dataclasses.dataclass
class ParticleConfig:
    """The atomic phantom of ``data.phantom=nanoparticle`` (fasttomo.data.atoms)."""

    radius: float = 12.0
    """Radius in Angstrom of the sphere cut from the FCC lattice (12 A: about 430 atoms of gold)."""
    lattice: float = 4.08
    """FCC lattice constant in Angstrom (gold 4.08: nearest neighbours 2.88 A apart)."""
    sigma: float = 0.5
    """Width (standard deviation) of each Gaussian atom in Angstrom."""
    species: int = 1
    """Number of species, 1 or 2 (species 2 is a random ``fraction`` of the atoms)."""
    fraction: float = 0.5
    """species=2: the fraction of atoms of species 2, drawn from phantom_seed."""
    contrast: float = 2.0
    """species=2: peak density of species 2 relative to species 1 (1.0)."""
    orientation: list = dataclasses.field(default_factory=lambda: [20.0, 30.0, 10.0])
    """z-x-z Euler angles (degrees) of the lattice, so no atom column lies along a tilt direction."""

    def __post_init__(self) -> None:
        for name in ("radius", "lattice", "sigma", "contrast"):
            _positive(getattr(self, name), f"data.particle.{name}")
        _require(self.species in (1, 2) and not isinstance(self.species, bool), "data.particle.species",
                 f"must be 1 or 2, got {self.species!r}.")
        _require(isinstance(self.fraction, (int, float)) and 0 <= self.fraction <= 1, "data.particle.fraction",
                 f"must be in [0, 1], got {self.fraction!r}.")
        _require(len(self.orientation) == 3 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                     and math.isfinite(v) for v in self.orientation),
                 "data.particle.orientation", f"must be 3 Euler angles in degrees, got {self.orientation!r}.")
        _require(self.sigma < self.lattice / 2, "data.particle.sigma",
                 f"= {self.sigma} A is too wide for atoms {self.lattice / math.sqrt(2):.3g} A apart (lattice "
                 f"{self.lattice} A); use a sigma below lattice / 2.")


@dataclasses.dataclass
class DataConfig:
    source: str = "phantom"
    """Where the tilt series comes from: phantom (built-in synthetic), mrc, hdf5 or tiff."""
    path: Optional[str] = None
    """Tilt-stack file (.mrc/.st/.ali/.h5/.tif) for source != phantom."""
    angles: Optional[str] = None
    """Angle file (.rawtlt/.tlt one angle per line in degrees, or SerialEM .mdoc). None: take the
    angles from the stack file itself (MRC extended header, HDF5 dataset)."""
    pixel_size: Optional[float] = None
    """Pixel size in Angstrom; overrides the file's value. None: from the file (phantom: 10 A,
    nanoparticle: 0.75 A)."""
    # --- built-in phantom
    width: int = 64
    """Phantom: image width W (pixels, along X)."""
    height: int = 64
    """Phantom: image height H (pixels, along Y = tilt axis)."""
    n_tilts: int = 61
    """Phantom: number of tilts, evenly spaced over [tilt_min, tilt_max]."""
    tilt_min: float = -60.0
    """Phantom: first tilt angle in degrees."""
    tilt_max: float = 60.0
    """Phantom: last tilt angle in degrees."""
    noise: float = 0.0
    """Phantom: Gaussian noise std as a fraction of the clean projections' std or maximum (see
    noise_relative_to); 0.05 is "5 % noise"."""
    noise_relative_to: str = "std"
    """Phantom: what ``noise`` is a fraction of: std (the standard deviation of all clean
    projection pixels) or max (their maximum, the usual "5 % noise" of tomography papers; at the
    same ``noise`` it is several times stronger than std)."""
    phantom: str = "default"
    """Phantom: which specimen: default (the deterministic built-in phantom with a right-handed
    helix; thickness None means about W/2), ellipsoids (n_ellipsoids random ellipsoids drawn
    from phantom_seed, see fasttomo.data.phantom.random_ellipsoids; thickness None means W, a cube
    for square images) or nanoparticle (an FCC particle of Gaussian atoms, see ``particle`` and
    fasttomo.data.atoms; thickness None means W; fasttomo-simulate writes the true atoms as
    <out>_atoms.csv for fasttomo-trace truth=)."""
    n_ellipsoids: int = 8
    """Phantom: number of random ellipsoids with phantom=ellipsoids (ignored by phantom=default)."""
    particle: ParticleConfig = dataclasses.field(default_factory=ParticleConfig)
    """Phantom: the atomic nanoparticle of phantom=nanoparticle (ignored otherwise)."""
    pose_error_shift: float = 0.0
    """Phantom: misalign the views by image shifts (su, sv) each uniform in +-pose_error_shift
    pixels; the reference view (smallest |angle|) keeps zero. The true poses are kept in the tilt
    series metadata (true_poses) and written by fasttomo-simulate as <out>_poses.json."""
    pose_error_rotation: float = 0.0
    """Phantom: misalign the views by in-plane image rotations z3 uniform in +-pose_error_rotation
    degrees (about the detector centre; z1 stays 0); the reference view keeps zero."""
    phantom_seed: int = 0
    """Phantom: the one seed of every random draw: the noise, the random specimen
    (phantom=ellipsoids) and the pose errors, each from its own stream, so switching one on or
    off never changes the others (the default specimen itself is fixed)."""
    # --- reconstruction box
    thickness: Optional[int] = None
    """Z size of the reconstructed volume in voxels (beam direction at 0 degrees). None: the
    phantom's own thickness, or W/2 for real data."""
    # --- preparation of real data (issue 3 adds the readers that use these)
    hdf5_stack: str = "/tiltseries/stack"
    """HDF5: dataset path of the (n_tilts, H, W) stack."""
    hdf5_angles: str = "/tiltseries/angles"
    """HDF5: dataset path (or attribute name on the stack) of the angles in degrees."""
    hdf5_pixel_size: str = "pixel_size_A"
    """HDF5: dataset path, or attribute name on the stack dataset or one of its parent groups, of
    the pixel size in Angstrom (fasttomo's own files: the /tiltseries attribute pixel_size_A)."""
    exclude_views: list = dataclasses.field(default_factory=list)
    """1-based view numbers to drop before anything else (as IMOD's -EXCLUDELIST)."""
    binning: int = 1
    """Bin the images by this integer factor (pixel size grows by it)."""
    crop: Optional[list] = None
    """[y0, y1, x0, x1] pixel window (after binning) to keep; None keeps all."""
    tilt_axis_angle: float = 0.0
    """Angle (degrees, counter-clockwise from the image Y axis) of the tilt axis in the raw images;
    the images are rotated (never transposed) so the axis lies along Y."""
    normalize: str = "none"
    """Intensity normalization before training: none (default: values are kept; the sampler divides
    by a robust scale internally and the volume comes back in the stack's units, while the
    background, i.e. the vacuum level, is handled by the intensity model, see ``intensity``) or
    quantile (maps the 1 % quantile to 0 and the 99.9 % quantile to 1: on noisy data the 1 %
    quantile lies well below the vacuum level, so every empty ray gets a positive value and the
    field fills the box to explain it; kept for comparison only)."""
    invert: bool = False
    """Invert contrast (bright-field data where mass is dark)."""
    intensity_offset: Optional[float] = None
    """Offset subtracted from integer data when converted to float32 (None: no offset)."""
    drop_dark_views: bool = False
    """Drop views detected as dark or blank (they are always reported in the log)."""
    nonfinite: str = "reject"
    """NaN/Inf pixels: reject (error) or mask (ignored in the loss)."""
    check_angle_units: bool = True
    """Refuse a file series whose largest |tilt angle| is below 2 degrees: such angles are almost
    certainly radians (fasttomo reads degrees). Set false for a series that really spans less
    than +-2 degrees."""

    def __post_init__(self) -> None:
        _choice(self.source, ("phantom", "mrc", "hdf5", "tiff"), "data.source")
        if self.source != "phantom":
            _require(bool(self.path), "data.path",
                     f"data.source={self.source} needs a file: set data.path=/path/to/stack.")
        for name in ("width", "height", "n_tilts"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 2, f"data.{name}", f"must be an integer >= 2, got {v!r}.")
        _require(-90 < self.tilt_min < self.tilt_max < 90, "data.tilt_min/tilt_max",
                 f"need -90 < tilt_min < tilt_max < 90 degrees, got {self.tilt_min}, {self.tilt_max}.")
        _nonneg(self.noise, "data.noise")
        _choice(self.noise_relative_to, ("std", "max"), "data.noise_relative_to")
        _choice(self.phantom, ("default", "ellipsoids", "nanoparticle"), "data.phantom")
        _require(isinstance(self.n_ellipsoids, int) and not isinstance(self.n_ellipsoids, bool)
                 and self.n_ellipsoids >= 1, "data.n_ellipsoids",
                 f"must be an integer >= 1, got {self.n_ellipsoids!r}; set data.n_ellipsoids=8 for example.")
        _nonneg(self.pose_error_shift, "data.pose_error_shift")
        _nonneg(self.pose_error_rotation, "data.pose_error_rotation")
        _require(self.pose_error_rotation <= 45.0, "data.pose_error_rotation",
                 f"is a half range in degrees and must be <= 45, got {self.pose_error_rotation!r}; "
                 "data.pose_error_rotation=1 means +-1 degree.")
        _require(isinstance(self.phantom_seed, int) and not isinstance(self.phantom_seed, bool)
                 and self.phantom_seed >= 0, "data.phantom_seed",
                 f"must be an integer >= 0, got {self.phantom_seed!r}; set data.phantom_seed=0 for example.")
        if self.pixel_size is not None:
            _positive(self.pixel_size, "data.pixel_size")
        if self.thickness is not None:
            _require(isinstance(self.thickness, int) and self.thickness >= 2, "data.thickness",
                     f"must be an integer >= 2 voxels, got {self.thickness!r}.")
        _require(isinstance(self.binning, int) and self.binning >= 1, "data.binning",
                 f"must be an integer >= 1, got {self.binning!r}.")
        _choice(self.normalize, ("quantile", "none"), "data.normalize")
        _choice(self.nonfinite, ("reject", "mask"), "data.nonfinite")
        _require(isinstance(self.check_angle_units, bool), "data.check_angle_units",
                 f"must be true or false, got {self.check_angle_units!r}.")
        if self.crop is not None:
            _require(len(self.crop) == 4 and all(isinstance(v, int) and v >= 0 for v in self.crop), "data.crop",
                     f"must be [y0, y1, x0, x1] of integers >= 0, got {self.crop!r}.")
            _require(self.crop[0] < self.crop[1] and self.crop[2] < self.crop[3], "data.crop",
                     f"needs y0 < y1 and x0 < x1, got {self.crop!r}.")
        _require(all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in self.exclude_views),
                 "data.exclude_views", f"must be 1-based view numbers (integers >= 1), got {self.exclude_views!r}.")
        _require(isinstance(self.tilt_axis_angle, (int, float)) and math.isfinite(self.tilt_axis_angle),
                 "data.tilt_axis_angle", f"must be a finite number of degrees, got {self.tilt_axis_angle!r}.")
        if self.intensity_offset is not None:
            _require(math.isfinite(self.intensity_offset), "data.intensity_offset",
                     f"must be a finite number, got {self.intensity_offset!r}.")
        for name in ("hdf5_stack", "hdf5_angles", "hdf5_pixel_size"):
            _require(isinstance(getattr(self, name), str) and bool(getattr(self, name)), f"data.{name}",
                     "must be a non-empty dataset path or attribute name.")


# --------------------------------------------------------------------------------------- model
@dataclasses.dataclass
class ModelConfig:
    kind: str = "kplanes_tilted"
    """Object model: kplanes_tilted (K-Planes in T learned rotated frames), voxel (plain grid fitted
    like the field) or sirt (the conventional SIRT on a voxel grid, same geometry and outputs; no
    training loop: the iterations below)."""
    n_rotations: int = 2
    """T: number of rotated frames (1 with learn_rotations=false is plain K-Planes)."""
    learn_rotations: bool = True
    """Learn the T frame rotations (frame 0 starts at identity, the others random)."""
    rotation_param: str = "quaternion"
    """Rotation parametrization: quaternion (unit 4-vector, sync-free on CUDA) or svd (free 3x3
    projected onto SO(3) by SVD, which synchronizes with the host on CUDA every step)."""
    channels: int = 8
    """C: feature channels per plane."""
    resolutions: Optional[list] = None
    """Plane resolution per scale: an int (isotropic) or [rx, ry, rz] per scale. None: N, N/2, ...
    with N the largest side of the reconstruction box, halving while a scale keeps >= 32 texels, at
    most three scales ([32, 64] for the embedded phantom, [32, 64, 128] for a 128^3 box)."""
    decoder: str = "hybrid"
    """Decoder head: linear (one layer) or hybrid (Linear-ReLU-Linear-ReLU-Linear)."""
    hidden: int = 32
    """Hidden width of the hybrid decoder."""
    activation: str = "softplus"
    """Density activation: softplus (shifted) or trunc_exp."""
    density_shift: float = -2.0
    """Shift added to the raw decoder output before the activation (softplus(x + shift))."""
    init_low: float = 0.1
    """Planes start uniform in [init_low, init_high] (K-Planes' multiplicative init)."""
    init_high: float = 0.5
    """See init_low."""
    voxel_shape: Optional[list] = None
    """voxel model only: [Z, Y, X] grid; None uses the reconstruction box."""
    iterations: int = 100
    """sirt only: number of SIRT iterations."""
    relaxation: float = 1.0
    """sirt only: relaxation factor lambda of the update x += lambda C B R (b - A x)."""
    positivity: bool = True
    """sirt only: clamp the volume at 0 after every iteration."""

    def __post_init__(self) -> None:
        _choice(self.kind, ("kplanes_tilted", "voxel", "sirt"), "model.kind")
        _require(isinstance(self.iterations, int) and self.iterations >= 1, "model.iterations",
                 f"must be an integer >= 1, got {self.iterations!r}.")
        _require(isinstance(self.relaxation, (int, float)) and 0 < self.relaxation < 2, "model.relaxation",
                 f"must be in (0, 2), got {self.relaxation!r}.")
        _require(isinstance(self.n_rotations, int) and self.n_rotations >= 1, "model.n_rotations",
                 f"must be an integer >= 1, got {self.n_rotations!r}.")
        _choice(self.rotation_param, ("svd", "quaternion"), "model.rotation_param")
        _require(isinstance(self.channels, int) and self.channels >= 1, "model.channels",
                 f"must be an integer >= 1, got {self.channels!r}.")
        _require(self.resolutions is None or len(self.resolutions) >= 1, "model.resolutions",
                 "needs at least one scale, e.g. [16, 32] (or null for the box-sized default).")
        for r in self.resolutions or []:
            ok = (isinstance(r, int) and r >= 2) or (
                isinstance(r, (list, tuple)) and len(r) == 3 and all(isinstance(v, int) and v >= 2 for v in r))
            _require(ok, "model.resolutions",
                     f"each scale must be an int >= 2 or [rx, ry, rz] of ints >= 2, got {r!r}.")
        _choice(self.decoder, ("linear", "hybrid"), "model.decoder")
        _require(isinstance(self.hidden, int) and self.hidden >= 1, "model.hidden", f"must be >= 1, got {self.hidden!r}.")
        _choice(self.activation, ("softplus", "trunc_exp"), "model.activation")
        _require(self.init_low < self.init_high, "model.init_low/init_high", "need init_low < init_high.")

    def resolution_triples(self) -> tuple[tuple[int, int, int], ...]:
        if self.resolutions is None:
            raise ValueError("model.resolutions is None (box-sized default): resolve it with "
                             "fasttomo.models.auto_resolutions(box) first")
        return tuple((r, r, r) if isinstance(r, int) else tuple(r) for r in self.resolutions)


# --------------------------------------------------------------------------------------- pose
@dataclasses.dataclass
class PoseConfig:
    learn: bool = False
    """Refine per-tilt poses (in-plane rotations z1, z3 and 2-D shifts; the tilt angle is fixed)."""
    learn_rotations: bool = True
    """With learn=true: refine the in-plane rotations (z3, and z1 unless learn_z1=false)."""
    learn_z1: bool = True
    """With learn_rotations: refine z1 (a rotation about the specimen's z before the tilt) as well
    as z3 (the image rotation after it); false refines the image rotation alone, what alignment
    programs call the per-view rotation."""
    learn_shifts: bool = True
    """With learn=true: refine the 2-D image shifts."""
    start_step: int = 0
    """Pose refinement starts after this many steps (the field settles first)."""

    def __post_init__(self) -> None:
        _require(isinstance(self.start_step, int) and self.start_step >= 0, "pose.start_step",
                 f"must be an integer >= 0, got {self.start_step!r}.")


# --------------------------------------------------------------------------------------- intensity
@dataclasses.dataclass
class IntensityConfig:
    background: str = "fixed"
    """How measured values relate to line integrals: measured = gain x integral + background.
    fixed (the robust vacuum estimate, or background_value, held fixed), learn (one offset learned
    with the field, starting there), learn_per_view (plus one learned offset per view) or none (no
    offset: the data is already background-subtracted). A learned offset trades against a uniform
    density in the box (the two explain nearly the same data), and early in a fit it drifts: on a
    short 32^2 run with a 500-count camera pedestal it fell by 8 counts and cost 0.1 in Pearson,
    while at 128^3 (bench_quality) fixed and learn scored alike. Use learn for data whose field of
    view holds no vacuum (the estimate is then the thinnest specimen). See src/fasttomo/intensity.py."""
    background_value: Optional[float] = None
    """Starting (or, with background=fixed, the) background in the stack's units; None: the robust
    vacuum estimate of src/fasttomo/data/background.py (logged at the start of the run)."""
    gain_per_view: bool = False
    """Learn one gain per view (beam-current or exposure drift); the reference view keeps gain 1."""

    def __post_init__(self) -> None:
        _choice(self.background, ("learn", "learn_per_view", "fixed", "none"), "intensity.background")
        if self.background_value is not None:
            _require(isinstance(self.background_value, (int, float)) and math.isfinite(self.background_value),
                     "intensity.background_value", f"must be a finite number or null, got {self.background_value!r}.")
        _require(isinstance(self.gain_per_view, bool), "intensity.gain_per_view",
                 f"must be true or false, got {self.gain_per_view!r}.")


# --------------------------------------------------------------------------------------- sampler
@dataclasses.dataclass
class SamplerConfig:
    kind: str = "device"
    """Batch sampler: device (device-resident index arithmetic) or dataloader (per-pixel torch
    DataLoader, kept for comparison)."""
    batch_size: Optional[int] = None
    """Rays per step (per rank under torchrun). None: 1024 x 2^round(log2(pixels / 2^18)) within
    [1024, 8192], so every step sees about 1/256 of the series (1024 for the embedded 61 x 64 x 64
    phantom, 4096 for 61 x 128 x 128)."""
    samples_per_ray: Optional[int] = None
    """S: quadrature points per ray. None: one per SAMPLE_SPACING (4/3) voxels of the longest chord
    through the box over the series' tilts (48 for the embedded 64 x 64 x 32 phantom at +-60)."""
    val_fraction: float = 0.02
    """Fraction of pixels held out for validation (fixed-seed split, identical on all ranks)."""
    split_seed: int = 12345
    """Seed of the train/validation split generator (independent of the run seed)."""
    drop_last: bool = True
    """Drop the ragged last batch of an epoch (keeps shapes fixed for CUDA graphs)."""
    num_workers: int = 0
    """dataloader sampler only: DataLoader worker processes."""
    skip_masked: bool = False
    """Leave masked pixels (tilt series validity mask False) out of the training and validation
    sets instead of yielding them with weight 0. The split itself is unchanged (made over all
    pixels), so it stays stable whatever the mask."""

    def __post_init__(self) -> None:
        _choice(self.kind, ("device", "dataloader"), "sampler.kind")
        _require(self.batch_size is None or (isinstance(self.batch_size, int) and self.batch_size >= 1),
                 "sampler.batch_size", f"must be an integer >= 1 or null (automatic), got {self.batch_size!r}.")
        _require(self.samples_per_ray is None or (isinstance(self.samples_per_ray, int) and self.samples_per_ray >= 1),
                 "sampler.samples_per_ray", f"must be an integer >= 1 or null (automatic), got {self.samples_per_ray!r}.")
        _require(0 <= self.val_fraction < 0.5, "sampler.val_fraction",
                 f"must be in [0, 0.5), got {self.val_fraction!r}.")
        _require(isinstance(self.num_workers, int) and self.num_workers >= 0, "sampler.num_workers",
                 f"must be an integer >= 0, got {self.num_workers!r}.")
        _require(isinstance(self.skip_masked, bool), "sampler.skip_masked",
                 f"must be true or false, got {self.skip_masked!r}.")


# --------------------------------------------------------------------------------------- optim
@dataclasses.dataclass
class OptimConfig:
    steps: int = 1500
    """Number of optimizer steps."""
    lr_grids: float = 2e-2
    """Adam learning rate of the plane / voxel parameters."""
    lr_decoder: float = 5e-3
    """Adam learning rate of the decoder MLP."""
    lr_rotations: float = 1e-3
    """Adam learning rate of the TILTED frame rotations."""
    lr_pose_rotations: float = 1e-4
    """Adam learning rate of the per-tilt in-plane rotations z1, z3 (radians: Adam moves a parameter
    by about this much per step, so 1e-4 is 0.006 degrees per step)."""
    lr_pose_shifts: float = 2e-2
    """Adam learning rate of the per-tilt image shifts (pixels: about this many pixels per step).
    Shifts and rotations get their own rates because their units differ: one rate for both either
    freezes the shifts or throws the rotations around."""
    lr_intensity: float = 1e-3
    """Adam learning rate of the intensity model (background offsets, per-view gains), in the
    sampler's normalized units."""
    betas: list = dataclasses.field(default_factory=lambda: [0.9, 0.99])
    """Adam betas."""
    eps: float = 1e-15
    """Adam epsilon."""
    weight_decay: float = 0.0
    """Adam (decoupled) weight decay."""
    grad_clip: Optional[float] = None
    """Clip the global gradient norm to this value; null turns clipping off."""
    keep_best: bool = False
    """Export the field as it was at the validation check with the lowest validation loss (held-out
    pixels) instead of the last step's: on noisy data the validation loss rises once the field
    starts fitting the noise. The checkpoint keeps both (exact resume)."""
    early_stop: int = 0
    """Stop after this many validation checks (logging.val_every apart) in a row without a new
    lowest validation loss; 0: never stop early."""

    def __post_init__(self) -> None:
        _require(isinstance(self.steps, int) and self.steps >= 1, "optim.steps",
                 f"must be an integer >= 1, got {self.steps!r}.")
        for name in ("lr_grids", "lr_decoder", "lr_rotations", "lr_pose_rotations", "lr_pose_shifts",
                     "lr_intensity"):
            _nonneg(getattr(self, name), f"optim.{name}")
        _require(len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas), "optim.betas",
                 f"must be two numbers in [0, 1), got {self.betas!r}.")
        _positive(self.eps, "optim.eps")
        _nonneg(self.weight_decay, "optim.weight_decay")
        if self.grad_clip is not None:
            _positive(self.grad_clip, "optim.grad_clip")
        _require(isinstance(self.early_stop, int) and self.early_stop >= 0, "optim.early_stop",
                 f"must be an integer >= 0 (validation checks), got {self.early_stop!r}.")


# --------------------------------------------------------------------------------------- schedule
@dataclasses.dataclass
class ScheduleConfig:
    kind: str = "cosine"
    """Learning-rate schedule: constant, cosine, exponential or plateau."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many steps (combines with every kind)."""
    min_factor: float = 0.05
    """cosine/exponential: the factor reached at the last step."""
    plateau_patience: int = 50
    """plateau: validation checks without improvement before the rate is cut."""
    plateau_factor: float = 0.5
    """plateau: multiply the rate by this on a plateau."""

    def __post_init__(self) -> None:
        _choice(self.kind, ("constant", "cosine", "exponential", "plateau"), "schedule.kind")
        _require(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "schedule.warmup_steps",
                 f"must be an integer >= 0, got {self.warmup_steps!r}.")
        _require(0 < self.min_factor <= 1, "schedule.min_factor", f"must be in (0, 1], got {self.min_factor!r}.")
        _require(0 < self.plateau_factor < 1, "schedule.plateau_factor",
                 f"must be in (0, 1), got {self.plateau_factor!r}.")


# --------------------------------------------------------------------------------------- loss
@dataclasses.dataclass
class LossConfig:
    kind: str = "mse"
    """Data term: mse, l1 or huber (see src/fasttomo/losses.py)."""
    huber_delta: float = 0.05
    """huber: the error (in units of the normalized targets, whose 99.9 % quantile is 1) where the
    loss turns from quadratic to linear."""
    s3im: float = 0.0
    """Weight of the S3IM term (stochastic structural similarity over random groups of the batch's
    rays, added to the data term; 0 turns it off)."""
    plane_tv: float = 1e-4
    """Weight of the plane total variation (K-Planes planes)."""
    volume_tv: float = 1e-3
    """Weight of the volume total variation (on density of a random sub-grid, or the voxel grid)."""
    volume_tv_kind: str = "l1"
    """Volume TV variant: squared (anisotropic squared differences) or l1."""
    volume_tv_points: int = 16
    """Side of the random sub-grid (n^3 points) on which volume TV is evaluated for fields."""

    def __post_init__(self) -> None:
        _choice(self.kind, ("mse", "l1", "huber"), "loss.kind")
        _positive(self.huber_delta, "loss.huber_delta")
        _nonneg(self.s3im, "loss.s3im")
        _nonneg(self.plane_tv, "loss.plane_tv")
        _nonneg(self.volume_tv, "loss.volume_tv")
        _choice(self.volume_tv_kind, ("squared", "l1"), "loss.volume_tv_kind")
        _require(isinstance(self.volume_tv_points, int) and self.volume_tv_points >= 2, "loss.volume_tv_points",
                 f"must be an integer >= 2, got {self.volume_tv_points!r}.")


# --------------------------------------------------------------------------------------- precision
@dataclasses.dataclass
class PrecisionConfig:
    dtype: str = "auto"
    """Autocast dtype of the field: auto (bf16 on a CUDA device that supports it, else fp32), fp32,
    bf16 or fp16 (fp16 uses a GradScaler). Rays, rotations and the line integral always run in
    fp32. bench_quality measured no quality difference between fp32 and bf16 fields (128^3,
    clean and 5 % noise) and bf16 steps are faster on the GPU; CPUs gain nothing from it."""

    def __post_init__(self) -> None:
        _choice(self.dtype, ("auto", "fp32", "bf16", "fp16"), "precision.dtype")


# --------------------------------------------------------------------------------------- kernels
@dataclasses.dataclass
class KernelsConfig:
    backend: str = "auto"
    """auto (fused Triton kernels where valid, else pure torch), triton (require them) or torch."""

    def __post_init__(self) -> None:
        _choice(self.backend, ("auto", "triton", "torch"), "kernels.backend")


# --------------------------------------------------------------------------------------- runtime
@dataclasses.dataclass
class RuntimeConfig:
    device: str = "auto"
    """auto (CUDA if available, else CPU), cpu, cuda or cuda:N."""
    seed: int = 0
    """The one seed that drives model init, batches and noise."""
    threads: Optional[int] = None
    """CPU threads for torch (None: torch's default)."""
    deterministic: bool = False
    """Ask torch for deterministic algorithms (slower)."""
    cuda_graph: str = "auto"
    """Capture the training step in a CUDA graph: auto (when the step can be captured: one CUDA
    process, fp32/bf16, no SVD rotations, fixed batch shapes; else eager, and the log says why),
    on (require it: an error names what prevents it) or off."""

    def __post_init__(self) -> None:
        _require(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
                 "runtime.device", f"must be auto, cpu, cuda or cuda:N, got {self.device!r}.")
        _choice(self.cuda_graph, ("auto", "on", "off"), "runtime.cuda_graph")
        if self.threads is not None:
            _require(isinstance(self.threads, int) and self.threads >= 1, "runtime.threads",
                     f"must be an integer >= 1, got {self.threads!r}.")


# --------------------------------------------------------------------------------------- guard
@dataclasses.dataclass
class GuardConfig:
    enabled: bool = True
    """Check every step's loss and gradient norm on the device (no host sync): a step with a
    non-finite or exploding loss or gradient is skipped (the parameters and optimizer state stay
    as they were); see the other keys for what happens when that repeats."""
    divergence_factor: float = 100.0
    """A step counts as exploding when its loss exceeds this many times the running average
    (EMA, decay 0.9) of the accepted steps' losses. 0 turns this test off (non-finite losses and
    gradients are still skipped)."""
    max_bad_steps: int = 5
    """After this many skipped steps in a row the run rolls back to its last good state (an
    in-memory snapshot) and lowers the learning rates by lr_factor."""
    lr_factor: float = 0.5
    """Learning rates are multiplied by this at each rollback (for the rest of the run)."""
    max_rollbacks: int = 5
    """Rollbacks allowed in one run; the next divergence ends the run with an error (exit code 3)
    after saving the last good state as checkpoints/last.pt."""
    check_every: int = 20
    """The host reads the guard's counters (one tiny sync) every N steps and at the end, so a
    rollback happens at most N steps after the bad streak reached max_bad_steps."""
    snapshot_every: int = 100
    """A snapshot of the parameters and optimizer state becomes the rollback target once it has
    been followed by this many steps without a skipped one (two snapshots are kept in device
    memory: 2 x (parameters + Adam moments))."""

    def __post_init__(self) -> None:
        _require(isinstance(self.enabled, bool), "guard.enabled", f"must be true or false, got {self.enabled!r}.")
        _nonneg(self.divergence_factor, "guard.divergence_factor")
        _require(self.divergence_factor == 0 or self.divergence_factor > 1, "guard.divergence_factor",
                 f"must be 0 (off) or > 1, got {self.divergence_factor!r}.")
        for name in ("max_bad_steps", "check_every", "snapshot_every"):
            v = getattr(self, name)
            _require(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"guard.{name}",
                     f"must be an integer >= 1, got {v!r}.")
        _require(isinstance(self.max_rollbacks, int) and not isinstance(self.max_rollbacks, bool)
                 and self.max_rollbacks >= 0, "guard.max_rollbacks",
                 f"must be an integer >= 0, got {self.max_rollbacks!r}.")
        _require(isinstance(self.lr_factor, (int, float)) and 0 < self.lr_factor < 1, "guard.lr_factor",
                 f"must be in (0, 1), got {self.lr_factor!r}.")


# --------------------------------------------------------------------------------------- logging
@dataclasses.dataclass
class LoggingConfig:
    log_every: int = 25
    """Scalars (losses, learning rates, step time) every N steps."""
    val_every: int = 100
    """Validation loss (fp32) every N steps."""
    image_every: int = 200
    """Central-slice images to TensorBoard every N steps (0: only at the end)."""
    tensorboard: bool = True
    """Write TensorBoard events under <run>/tb."""
    progress: bool = True
    """Show a tqdm progress bar with ETA."""
    checkpoint_every: int = 0
    """Write a checkpoint every N steps (0: only at the end)."""

    def __post_init__(self) -> None:
        for name in ("log_every", "val_every"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 1, f"logging.{name}", f"must be an integer >= 1, got {v!r}.")
        for name in ("image_every", "checkpoint_every"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 0, f"logging.{name}", f"must be an integer >= 0, got {v!r}.")


# --------------------------------------------------------------------------------------- evaluation
@dataclasses.dataclass
class EvaluationConfig:
    truth: Optional[str] = None
    """Ground-truth volume file (MRC/HDF5/TIFF, (Z, Y, X) = the reconstruction box) of synthetic data
    given as files: the result is scored against it (Pearson, FSC, PSNR) like the built-in phantom's."""
    curve_every: int = 0
    """Score the volume against the ground truth every N steps (SIRT: iterations) for a quality
    against fit-time curve in metrics.json; the scoring time is not counted as fit time. 0: at the
    end only."""
    holdout_views: list = dataclasses.field(default_factory=list)
    """1-based view numbers (as in the file, like data.exclude_views) left out of training and
    scored by reprojection: the reconstruction predicts each held-out image, compared with the
    measured one (Pearson per view). Needs no ground truth."""
    true_poses: Optional[str] = None
    """A poses file of synthetic data (fasttomo-simulate's <out>_poses.json): with pose.learn the
    learned poses are scored against it (RMS shift and rotation errors, see
    src/fasttomo/geometry/alignment.py) in metrics.json."""
    half_sets: bool = False
    """Also reconstruct the even and the odd views separately (two more fits, same settings) and
    report their Fourier shell correlation (the 0.143 crossing is the usual resolution estimate of
    the full reconstruction), and write volume_even.mrc / volume_odd.mrc. Needs no ground truth."""

    def __post_init__(self) -> None:
        _require(isinstance(self.curve_every, int) and self.curve_every >= 0, "evaluation.curve_every",
                 f"must be an integer >= 0, got {self.curve_every!r}.")
        _require(all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in self.holdout_views),
                 "evaluation.holdout_views", f"must be 1-based view numbers (integers >= 1), got {self.holdout_views!r}.")
        _require(isinstance(self.half_sets, bool), "evaluation.half_sets",
                 f"must be true or false, got {self.half_sets!r}.")


# --------------------------------------------------------------------------------------- output
@dataclasses.dataclass
class OutputConfig:
    dir: Optional[str] = None
    """Run folder. Set by the entry point from Hydra's run dir. A folder holding another run's
    results is refused (see overwrite); one holding only a failed run's files is reused."""
    volume_shape: Optional[list] = None
    """[Z, Y, X] of the exported volume; None: the reconstruction box at pixel sampling."""
    formats: list = dataclasses.field(default_factory=lambda: ["mrc", "h5"])
    """Volume files to write: any of mrc, h5, tiff."""
    imod_xzy: bool = False
    """Also write the volume in IMOD's un-rotated XZY orientation (as before trimvol -rx)."""
    overwrite: bool = False
    """Replace the results of an earlier run in the folder: every file that run wrote (listed in
    its manifest.json) is removed before anything is written. Other files are kept."""

    def __post_init__(self) -> None:
        for f in self.formats:
            _choice(f, ("mrc", "h5", "tiff"), "output.formats[]")


@dataclasses.dataclass
class Config:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    pose: PoseConfig = dataclasses.field(default_factory=PoseConfig)
    intensity: IntensityConfig = dataclasses.field(default_factory=IntensityConfig)
    sampler: SamplerConfig = dataclasses.field(default_factory=SamplerConfig)
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    schedule: ScheduleConfig = dataclasses.field(default_factory=ScheduleConfig)
    loss: LossConfig = dataclasses.field(default_factory=LossConfig)
    precision: PrecisionConfig = dataclasses.field(default_factory=PrecisionConfig)
    kernels: KernelsConfig = dataclasses.field(default_factory=KernelsConfig)
    runtime: RuntimeConfig = dataclasses.field(default_factory=RuntimeConfig)
    logging: LoggingConfig = dataclasses.field(default_factory=LoggingConfig)
    evaluation: EvaluationConfig = dataclasses.field(default_factory=EvaluationConfig)
    guard: GuardConfig = dataclasses.field(default_factory=GuardConfig)
    output: OutputConfig = dataclasses.field(default_factory=OutputConfig)
    resume: Optional[str] = None
    """Checkpoint file to continue from (exact resume), or a run folder (its newest intact
    checkpoint). The run's settings come from the checkpoint; settings given on the command line
    replace only what they name, and those that cannot change (data, model, sampler split and
    batch, pose switches) are refused."""
    dry_run: bool = False
    """Check the config and the data, build the model, print the memory and disk estimates and
    whether the run folder can be used, then exit without training or writing anything."""
    name: str = "fasttomo"
    """Run name (written in the MRC label and metadata)."""


# --------------------------------------------------------------------------------------- dict -> dataclass
def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if origin in (Union, types.UnionType):
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp in (list, dict, str, bool):
        return isinstance(value, tp)
    return True


def from_dict(cls: type, data: dict | None, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a plain dict, rejecting unknown keys and wrong types."""
    data = dict(data or {})
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = prefix.rstrip(".") or "config"
        raise ConfigError(
            f"{where}: unknown key(s) {unknown}; valid keys are {sorted(fields)}. "
            "Check the spelling (use +key=value only for keys the schema knows)."
        )
    kwargs = {}
    for name, value in data.items():
        tp = hints[name]
        field = f"{prefix}{name}"
        if dataclasses.is_dataclass(tp):
            _require(isinstance(value, dict) or value is None, field, f"must be a group (mapping), got {value!r}.")
            kwargs[name] = from_dict(tp, value, prefix=f"{field}.")
            continue
        args = typing.get_args(tp) or (tp,)
        if isinstance(value, int) and not isinstance(value, bool) and float in args and int not in args:
            value = float(value)
        _require(_type_ok(value, tp), field,
                 f"has the wrong type: got {value!r} ({type(value).__name__}), expected {tp}.")
        kwargs[name] = value
    return cls(**kwargs)


def to_dict(cfg: Any) -> dict:
    """A plain, JSON/YAML-serializable dict of a config dataclass."""
    return dataclasses.asdict(cfg)
