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


def config_dir() -> str:
    """The configs folder: shipped inside the package (wheel install) or at the repository top
    level (source checkout / editable install)."""
    from pathlib import Path

    here = Path(__file__).resolve().parent
    for cand in (here / "configs", here.parents[1] / "configs"):
        if (cand / "reconstruct.yaml").is_file():
            return str(cand)
    raise FileNotFoundError(f"fasttomo: no configs folder found next to {here}; reinstall the package.")


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


# --------------------------------------------------------------------------------------- group options
class GroupOption:
    """Base of a config group whose options read different keys (data sources, model kinds,
    samplers, schedules, pose modes). The group's base class names its ``_selector`` key and maps
    each value of it to the dataclass of that option in ``_options``; constructing the base class
    (``DataConfig(source="mrc", ...)``) builds the option's class, so a key the chosen option does
    not read is an error (see :func:`from_dict`), never silently ignored."""

    _selector: typing.ClassVar[str] = ""
    _options: typing.ClassVar[dict] = {}
    _group: typing.ClassVar[str] = ""

    def __new__(cls, *args, **kwargs):
        base = cls.group_base()
        if cls is base:
            sel = kwargs.get(cls._selector, base._default_option())
            _choice(sel, tuple(base._options), f"{base._group}.{base._selector}")
            cls = base._options[sel]
        return object.__new__(cls)

    @classmethod
    def group_base(cls) -> type:
        for klass in cls.__mro__:
            if klass.__dict__.get("_options"):
                return klass
        return cls

    @classmethod
    def _default_option(cls):
        return {f.name: f for f in dataclasses.fields(cls)}[cls._selector].default

    @classmethod
    def option_class(cls, value) -> type:
        """The dataclass of the option whose selector key is ``value``."""
        base = cls.group_base()
        _choice(value, tuple(base._options), f"{base._group}.{base._selector}")
        return base._options[value]

    @classmethod
    def option_classes(cls) -> list[type]:
        base = cls.group_base()
        return list(dict.fromkeys(base._options.values()))


def option_keys(cls: type) -> list[str]:
    """The keys the dataclass ``cls`` (one group option) reads, in declaration order."""
    return [f.name for f in dataclasses.fields(cls)]


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
    """[z, x, z] Euler angles (degrees) of the lattice, so no atom column lies along a tilt direction."""

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
class DataConfig(GroupOption):
    """The ``data`` group: one option per source (``data.source``): :class:`PhantomDataConfig`
    (phantom), :class:`FileDataConfig` (mrc, tiff) and :class:`Hdf5DataConfig` (hdf5). The keys
    here are read by every source."""

    source: str = "phantom"
    """Where the tilt series comes from: phantom (built-in synthetic), mrc, hdf5 or tiff."""
    pixel_size: Optional[float] = None
    """Pixel size in Angstrom; overrides the file's value. None: from the file (phantom: 10 A,
    nanoparticle: 0.75 A, catalyst: 2.5 A)."""
    thickness: Optional[int] = None
    """Z size of the reconstructed volume in voxels (beam direction at 0 degrees). None: the
    phantom's own thickness, or W/2 for real data."""

    def _check_common(self) -> None:
        if self.pixel_size is not None:
            _positive(self.pixel_size, "data.pixel_size")
        if self.thickness is not None:
            _require(isinstance(self.thickness, int) and self.thickness >= 2, "data.thickness",
                     f"must be an integer >= 2 voxels, got {self.thickness!r}.")

    def __post_init__(self) -> None:
        self._check_common()


@dataclasses.dataclass
class PhantomDataConfig(DataConfig):
    """data=phantom: the built-in synthetic tilt series (src/fasttomo/data/phantom.py)."""

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
    dose: Optional[float] = None
    """Phantom: electrons per pixel per view; the images become Poisson counts of a linear
    bright-field model, offset + gain x Poisson(dose x (1 - absorption x P / max P)) for the line
    integral P (see fasttomo.data.dose). None: no shot noise (the exact line integrals)."""
    gain: float = 1.0
    """Phantom (with dose): detector counts per electron."""
    offset: float = 0.0
    """Phantom (with dose): detector offset added to every pixel (counts)."""
    absorption: float = 0.3
    """Phantom (with dose): the fraction of the beam that the most absorbing ray of the series
    removes (the slope of the linear model), in (0, 1)."""
    invert: Optional[bool] = None
    """Phantom: invert the contrast (x -> max - x, as data.invert for file data) so that mass is
    bright. None: true with a dose (bright-field counts are mass-dark), false otherwise."""
    phantom: str = "default"
    """Phantom: which specimen: default (the deterministic built-in phantom with a right-handed
    helix; thickness None means about W/2), ellipsoids (n_ellipsoids random ellipsoids drawn
    from phantom_seed, see fasttomo.data.phantom.random_ellipsoids; thickness None means W, a cube
    for square images), nanoparticle (an FCC particle of Gaussian atoms, see ``particle`` and
    fasttomo.data.atoms; thickness None means W; fasttomo-simulate writes the true atoms as
    <out>_atoms.csv for fasttomo-trace truth=), cell (a vesicle-rich cytoplasm section: lipid
    bilayers, actin-like filaments, ribosomes, a crowded texture and gold fiducials; pixel size
    None means 10 A, thickness None about W/2) or catalyst (a porous support with heavy
    crystalline particles of 1-10 nm; pixel size None means 2.5 A, thickness None W); both in
    fasttomo.data.specimens, sizes in Angstrom (docs/specimens.md)."""
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
    tilt_axis_error: float = 0.0
    """Phantom: an error of the tilt-axis angle, in degrees: one in-plane image rotation added to
    every view, the reference view's included (what a wrong tilt-axis angle does to real data)."""
    phantom_seed: int = 0
    """Phantom: the one seed of every random draw: the noise, the random specimen
    (phantom=ellipsoids) and the pose errors, each from its own stream, so switching one on or
    off never changes the others (the default specimen itself is fixed)."""

    def __post_init__(self) -> None:
        _choice(self.source, ("phantom",), "data.source")
        self._check_common()
        for name in ("width", "height", "n_tilts"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 2, f"data.{name}", f"must be an integer >= 2, got {v!r}.")
        _require(-90 < self.tilt_min < self.tilt_max < 90, "data.tilt_min/tilt_max",
                 f"need -90 < tilt_min < tilt_max < 90 degrees, got {self.tilt_min}, {self.tilt_max}.")
        _nonneg(self.noise, "data.noise")
        _choice(self.noise_relative_to, ("std", "max"), "data.noise_relative_to")
        _choice(self.phantom, ("default", "ellipsoids", "nanoparticle", "cell", "catalyst"), "data.phantom")
        self._check_detector()
        _require(isinstance(self.n_ellipsoids, int) and not isinstance(self.n_ellipsoids, bool)
                 and self.n_ellipsoids >= 1, "data.n_ellipsoids",
                 f"must be an integer >= 1, got {self.n_ellipsoids!r}; set data.n_ellipsoids=8 for example.")
        _nonneg(self.pose_error_shift, "data.pose_error_shift")
        _nonneg(self.pose_error_rotation, "data.pose_error_rotation")
        _require(self.pose_error_rotation <= 45.0, "data.pose_error_rotation",
                 f"is a half range in degrees and must be <= 45, got {self.pose_error_rotation!r}; "
                 "data.pose_error_rotation=1 means +-1 degree.")
        _require(isinstance(self.tilt_axis_error, (int, float)) and not isinstance(self.tilt_axis_error, bool)
                 and math.isfinite(self.tilt_axis_error) and abs(self.tilt_axis_error) <= 45.0,
                 "data.tilt_axis_error", f"is an angle in degrees in [-45, 45], got {self.tilt_axis_error!r}; "
                 "data.tilt_axis_error=1 rotates every view's image by 1 degree.")
        _require(isinstance(self.phantom_seed, int) and not isinstance(self.phantom_seed, bool)
                 and self.phantom_seed >= 0, "data.phantom_seed",
                 f"must be an integer >= 0, got {self.phantom_seed!r}; set data.phantom_seed=0 for example.")

    def _check_detector(self) -> None:
        if self.dose is not None:
            _positive(self.dose, "data.dose")
        _positive(self.gain, "data.gain")
        _require(isinstance(self.offset, (int, float)) and not isinstance(self.offset, bool)
                 and math.isfinite(self.offset), "data.offset", f"must be a finite number of counts, got {self.offset!r}.")
        _require(isinstance(self.absorption, (int, float)) and 0 < self.absorption < 1, "data.absorption",
                 f"must lie in (0, 1) (the fraction of the beam the densest ray removes), got {self.absorption!r}.")
        _require(self.invert is None or isinstance(self.invert, bool), "data.invert",
                 f"must be true, false or null (true with a dose), got {self.invert!r}.")


@dataclasses.dataclass
class FileDataConfig(DataConfig):
    """data=mrc and data=tiff: a tilt stack read from a file, then prepared
    (src/fasttomo/data/prepare.py applies exclude_views ... normalize in this order)."""

    source: str = "mrc"
    path: Optional[str] = None
    """Tilt-stack file (.mrc/.st/.ali/.h5/.tif); required."""
    angles: Optional[str] = None
    """Angle file (.rawtlt/.tlt one angle per line in degrees, or SerialEM .mdoc). None: take the
    angles from the stack file itself (MRC extended header, HDF5 dataset); TIFF needs one."""
    xf: Optional[str] = None
    """IMOD .xf (or .prexg) alignment of the raw stack (one A11 A12 A21 A22 DX DY line per section):
    read as each view's initial in-plane rotation and shift, applied as newstack -xf would; with
    pose=refine, refined from there (fasttomo.data.io.alignment; docs/alignment.md). Give the
    refined tilts (.tlt) as data.angles. None: no file alignment."""
    aln: Optional[str] = None
    """AreTomo .aln alignment of the raw stack (ROT, TX, TY per section; its TILT column gives the
    angles unless data.angles is set): like data.xf. None: no file alignment."""
    xtilt: Optional[str] = None
    """IMOD .xtilt (X-axis tilt per section) going with data.xf: one value for the whole series is
    accepted (the volume comes out un-tilted about X), values that differ are refused."""
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
    hot_pixels: str = "mask"
    """Hot pixels and X-ray hits: mask (ignored in the loss, counted in the log) or keep. Masked: a
    pixel brighter than the second-brightest of its 8 neighbours by more than its view's whole
    0.1-99.9 % intensity range, or a cluster of up to 6 pixels whose brightest exceeds the
    6th-brightest of its 24 neighbours by that much, when the views of the next tilt angles do not
    show it where structure would have moved across the tilt axis (data.tilt_axis_angle), or when it
    is hot in a quarter of the views or more (a camera defect). Small bright particles are in every
    view and stay."""
    check_angle_units: bool = True
    """Refuse a file series whose largest |tilt angle| is below 2 degrees: such angles are almost
    certainly radians (fasttomo reads degrees). Set false for a series that really spans less
    than +-2 degrees."""

    _sources: typing.ClassVar[tuple] = ("mrc", "tiff")

    def __post_init__(self) -> None:
        _choice(self.source, self._sources, "data.source")
        self._check_common()
        _require(bool(self.path), "data.path",
                 f"data.source={self.source} needs a file: set data.path=/path/to/stack.")
        if self.source == "tiff":
            _require(bool(self.angles), "data.angles",
                     "a TIFF stack holds no tilt angles: set data.angles=/path/to/angles.rawtlt (or .tlt, .mdoc).")
        _require(isinstance(self.binning, int) and self.binning >= 1, "data.binning",
                 f"must be an integer >= 1, got {self.binning!r}.")
        _choice(self.normalize, ("quantile", "none"), "data.normalize")
        _choice(self.nonfinite, ("reject", "mask"), "data.nonfinite")
        _choice(self.hot_pixels, ("mask", "keep"), "data.hot_pixels")
        _require(isinstance(self.check_angle_units, bool), "data.check_angle_units",
                 f"must be true or false, got {self.check_angle_units!r}.")
        self._check_alignment_files()
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


    def _check_alignment_files(self) -> None:
        _require(not (self.xf and self.aln), "data.xf/data.aln",
                 "give one alignment of the raw stack: an IMOD .xf or an AreTomo .aln, not both.")
        _require(not self.xtilt or bool(self.xf), "data.xtilt",
                 "is IMOD's X-axis tilt of an .xf alignment, which an AreTomo .aln has no place for: leave "
                 "data.xtilt unset with data.aln." if self.aln else
                 "is IMOD's X-axis tilt of an .xf alignment: set data.xf too (or leave data.xtilt unset).")
        if self.xf or self.aln:
            _require(not self.tilt_axis_angle, "data.tilt_axis_angle",
                     "must be 0 with data.xf/data.aln: the alignment already turns the tilt axis onto Y.")
            _require(self.crop is None, "data.crop",
                     "must be null with data.xf/data.aln: they align the whole raw image (crop the volume after).")


@dataclasses.dataclass
class Hdf5DataConfig(FileDataConfig):
    """data=hdf5: an HDF5 tilt series (fasttomo's own layout by default, see
    src/fasttomo/data/io/hdf5.py), prepared like the other files."""

    source: str = "hdf5"
    hdf5_stack: str = "/tiltseries/stack"
    """HDF5: dataset path of the (n_tilts, H, W) stack."""
    hdf5_angles: str = "/tiltseries/angles"
    """HDF5: dataset path (or attribute name on the stack) of the angles in degrees."""
    hdf5_pixel_size: str = "pixel_size_A"
    """HDF5: dataset path, or attribute name on the stack dataset or one of its parent groups, of
    the pixel size in Angstrom (fasttomo's own files: the /tiltseries attribute pixel_size_A)."""

    _sources: typing.ClassVar[tuple] = ("hdf5",)

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("hdf5_stack", "hdf5_angles", "hdf5_pixel_size"):
            _require(isinstance(getattr(self, name), str) and bool(getattr(self, name)), f"data.{name}",
                     "must be a non-empty dataset path or attribute name.")


DataConfig._selector, DataConfig._group = "source", "data"
DataConfig._options = {"phantom": PhantomDataConfig, "mrc": FileDataConfig, "tiff": FileDataConfig,
                       "hdf5": Hdf5DataConfig}


# --------------------------------------------------------------------------------------- model
@dataclasses.dataclass
class ModelConfig(GroupOption):
    """The ``model`` group: one option per ``model.kind``: :class:`KPlanesConfig`
    (kplanes_tilted), :class:`VoxelConfig` (voxel) and :class:`SirtConfig` (sirt)."""

    kind: str = "kplanes_tilted"
    """Object model: kplanes_tilted (K-Planes in T learned rotated frames), voxel (plain grid fitted
    like the field) or sirt (the conventional SIRT on a voxel grid, same geometry and outputs; no
    training loop: the iterations below)."""

    def __post_init__(self) -> None:
        _choice(self.kind, tuple(self._options), "model.kind")


@dataclasses.dataclass
class FieldConfig(ModelConfig):
    """What every fitted field reads (the density activation)."""

    activation: str = "softplus"
    """Density activation: softplus (shifted) or trunc_exp."""
    density_shift: float = -2.0
    """Shift added to the raw decoder output before the activation (softplus(x + shift))."""

    def __post_init__(self) -> None:
        _choice(self.activation, ("softplus", "trunc_exp"), "model.activation")


@dataclasses.dataclass
class KPlanesConfig(FieldConfig):
    """model=kplanes_tilted (and model=kplanes, its one-frame setting): multi-scale K-Planes sampled
    in T rotated frames + a decoder (src/fasttomo/models/kplanes.py)."""

    n_rotations: int = 2
    """T: number of rotated frames (1 with learn_frames=false is plain K-Planes)."""
    learn_frames: bool = True
    """Learn the T frame rotations (frame 0 starts at identity, the others random)."""
    rotation_param: str = "quaternion"
    """Frame rotation parametrization: quaternion (unit 4-vector, sync-free on CUDA) or svd (free
    3x3 projected onto SO(3) by SVD, which synchronizes with the host on CUDA every step)."""
    channels: int = 8
    """C: feature channels per plane."""
    resolutions: Optional[list] = None
    """Plane resolution per scale: an int (isotropic) or [rx, ry, rz] per scale. None: F, F/2, ...
    with F the largest side N of the reconstruction box up to 256 and N/2 above, halving while a
    scale keeps >= 32 texels, at most three scales ([32, 64] for the embedded phantom, [32, 64,
    128] for a 128^3 box, [128, 256, 512] for a 1024-pixel camera; models.auto_resolutions)."""
    decoder: str = "hybrid"
    """Decoder head: linear (one layer) or hybrid (Linear-ReLU-Linear-ReLU-Linear)."""
    hidden: int = 32
    """Hidden width of the hybrid decoder."""
    init_low: float = 0.1
    """Planes start uniform in [init_low, init_high] (K-Planes' multiplicative init)."""
    init_high: float = 0.5
    """See init_low."""

    def __post_init__(self) -> None:
        _choice(self.kind, ("kplanes_tilted",), "model.kind")
        super().__post_init__()
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
        _require(self.init_low < self.init_high, "model.init_low/init_high", "need init_low < init_high.")

    def resolution_triples(self) -> tuple[tuple[int, int, int], ...]:
        if self.resolutions is None:
            raise ValueError("model.resolutions is None (box-sized default): resolve it with "
                             "fasttomo.models.auto_resolutions(box) first")
        return tuple((r, r, r) if isinstance(r, int) else tuple(r) for r in self.resolutions)


@dataclasses.dataclass
class VoxelConfig(FieldConfig):
    """model=voxel: a plain learnable voxel grid fitted like the field (src/fasttomo/models/voxel.py)."""

    kind: str = "voxel"
    density_shift: float = 0.0
    """Shift added to the grid values before the activation."""
    voxel_shape: Optional[list] = None
    """[Z, Y, X] grid; None uses the reconstruction box."""

    def __post_init__(self) -> None:
        _choice(self.kind, ("voxel",), "model.kind")
        super().__post_init__()
        if self.voxel_shape is not None:
            _require(len(self.voxel_shape) == 3 and all(isinstance(v, int) and v >= 2 for v in self.voxel_shape),
                     "model.voxel_shape", f"must be [Z, Y, X] of integers >= 2 or null, got {self.voxel_shape!r}.")


@dataclasses.dataclass
class SirtConfig(ModelConfig):
    """model=sirt: the conventional SIRT on a voxel grid of the reconstruction box, no training loop
    (src/fasttomo/methods/sirt/solver.py)."""

    kind: str = "sirt"
    iterations: int = 100
    """Number of SIRT iterations."""
    relaxation: float = 1.0
    """Relaxation factor lambda of the update x += lambda C B R (b - A x)."""
    positivity: bool = True
    """Clamp the volume at 0 after every iteration."""

    def __post_init__(self) -> None:
        _choice(self.kind, ("sirt",), "model.kind")
        _require(isinstance(self.iterations, int) and self.iterations >= 1, "model.iterations",
                 f"must be an integer >= 1, got {self.iterations!r}.")
        _require(isinstance(self.relaxation, (int, float)) and 0 < self.relaxation < 2, "model.relaxation",
                 f"must be in (0, 2), got {self.relaxation!r}.")


ModelConfig._selector, ModelConfig._group = "kind", "model"
ModelConfig._options = {"kplanes_tilted": KPlanesConfig, "voxel": VoxelConfig, "sirt": SirtConfig}


# --------------------------------------------------------------------------------------- pose
@dataclasses.dataclass
class PoseConfig(GroupOption):
    """The ``pose`` group: pose=fixed (``learn: false``, the poses as given: this class) or
    pose=refine (``learn: true``, :class:`PoseRefineConfig`)."""

    learn: bool = False
    """Refine per-tilt poses (the in-plane rotation z3, z1 too with pose.learn_z1=true, and 2-D
    shifts; the tilt angle is fixed)."""

    def __post_init__(self) -> None:
        _require(self.learn is False, "pose.learn", f"is false for fixed poses, got {self.learn!r}.")


@dataclasses.dataclass
class PoseRefineConfig(PoseConfig):
    """pose=refine: which parts of the per-tilt poses are learned, and from when."""

    learn: bool = True
    learn_rotations: bool = True
    """Refine the in-plane rotations (z3, and z1 unless learn_z1=false). On a crowded specimen they
    may wander: the cell specimen's rotations came to 0.42-0.50 degree RMS from 0.53 with a lower
    FSC to the truth than shifts alone, and rotations already within 0.5 degree went to 1.3
    (benchmarks/README.md); false keeps the given rotations (an IMOD or AreTomo alignment) and
    still refines the shifts."""
    learn_z1: bool = False
    """With learn_rotations: refine z1 (a rotation about the specimen's z before the tilt: a
    per-view tilt-axis direction) as well as z3 (the image rotation after it). false (default)
    refines the image rotation alone, what alignment programs call the per-view rotation: z1 and z3
    are nearly one rotation at low tilt, and the split the data cannot fix shows up as an
    out-of-plane error (bench_quality pose128 on one H200: 0.176 degree RMS with z1 and z3, 0.089
    with z3 alone at optim.lr_pose_rotations=1e-3; benchmarks/README.md)."""
    learn_shifts: bool = True
    """Refine the 2-D image shifts."""
    free_reference_shift: bool = True
    """With learn_shifts: learn the reference view's shift too during the fit (the volume's
    position is then a free direction instead of a slow one) and report poses and volume in the
    frame where it is zero (fasttomo.geometry.poses); false pins it to zero throughout."""
    learn_tilt_axis: bool = True
    """With learn_rotations and learn_z1=false: learn one image rotation common to every view, the
    reference view's included: an error of the tilt-axis angle (metrics.json poses.tilt_axis_deg);
    the tilted views fix it. Ignored with learn_z1=true (z1 on every view and a turn of the volume
    would explain the same images)."""
    start_step: int = 0
    """Pose refinement starts after this many steps (the field settles first)."""

    def __post_init__(self) -> None:
        _require(self.learn is True, "pose.learn", f"is true for refined poses, got {self.learn!r}.")
        _require(isinstance(self.start_step, int) and self.start_step >= 0, "pose.start_step",
                 f"must be an integer >= 0, got {self.start_step!r}.")


PoseConfig._selector, PoseConfig._group = "learn", "pose"
PoseConfig._options = {False: PoseConfig, True: PoseRefineConfig}


# --------------------------------------------------------------------------------------- projector
@dataclasses.dataclass
class ProjectorConfig:
    """The ``projector`` section: how the line integrals of a fitted field are sampled
    (src/fasttomo/methods/field/projector.py; model=sirt has its own projectors and reads none of it, like the
    optim and loss groups)."""

    samples_per_ray: Optional[int] = None
    """S: quadrature points per ray. None: one per SAMPLE_SPACING (4/3) voxels of the longest chord
    through the box over the series' tilts (48 for the embedded 64 x 64 x 32 phantom at +-60)."""

    def __post_init__(self) -> None:
        _require(self.samples_per_ray is None or (isinstance(self.samples_per_ray, int) and self.samples_per_ray >= 1),
                 "projector.samples_per_ray",
                 f"must be an integer >= 1 or null (automatic), got {self.samples_per_ray!r}.")


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
    view holds no vacuum (the estimate is then the thinnest specimen). See src/fasttomo/methods/field/intensity.py."""
    background_value: Optional[float] = None
    """Starting (or, with background=fixed, the) background in the stack's units; None: the robust
    vacuum estimate of src/fasttomo/data/background.py (logged at the start of the run)."""
    gain_per_view: bool = False
    """Learn one gain per view (beam-current or exposure drift); the reference view keeps gain 1."""

    def __post_init__(self) -> None:
        _choice(self.background, ("learn", "learn_per_view", "fixed", "none"), "intensity.background")
        _require(self.background == "none" and self.background_value is None or self.background != "none",
                 "intensity.background_value", "intensity.background=none does not read this key (there is no "
                 "background term); remove it, or choose intensity=fixed|learn|per_view.")
        if self.background_value is not None:
            _require(isinstance(self.background_value, (int, float)) and math.isfinite(self.background_value),
                     "intensity.background_value", f"must be a finite number or null, got {self.background_value!r}.")
        _require(isinstance(self.gain_per_view, bool), "intensity.gain_per_view",
                 f"must be true or false, got {self.gain_per_view!r}.")


# --------------------------------------------------------------------------------------- sampler
@dataclasses.dataclass
class SamplerConfig(GroupOption):
    """The ``sampler`` group: sampler=device (this class) or sampler=dataloader
    (:class:`DataLoaderSamplerConfig`)."""

    kind: str = "device"
    """Batch sampler: device (device-resident index arithmetic) or dataloader (per-pixel torch
    DataLoader, kept for comparison)."""
    batch_size: Optional[int] = None
    """Rays per step (per rank under torchrun). None: 1024 x 2^round(log2(pixels / 2^18)) within
    [1024, 8192], so every step sees about 1/256 of the series (1024 for the embedded 61 x 64 x 64
    phantom, 4096 for 61 x 128 x 128), and at most one rank's training pixels (a tiny series)."""
    val_fraction: float = 0.02
    """Fraction of pixels held out for validation (fixed-seed split, identical on all ranks)."""
    split_seed: int = 12345
    """Seed of the train/validation split generator (independent of the run seed)."""
    drop_last: bool = True
    """Drop the ragged last batch of an epoch (keeps shapes fixed for CUDA graphs)."""
    skip_masked: bool = False
    """Leave masked pixels (tilt series validity mask False) out of the training and validation
    sets instead of yielding them with weight 0. The split itself is unchanged (made over all
    pixels), so it stays stable whatever the mask."""
    order: Optional[str] = None
    """How the split and each epoch's order are drawn: stored (torch.randperm of every pixel id,
    kept in memory), hashed (keyed Feistel permutations evaluated a chunk of batches at a time:
    no list of every pixel, nothing drawn up front) or null: stored up to 2^24 pixels, hashed above
    (a 2048^2 x 121 series: 507 M pixels, 4 GB per id list and tens of seconds of randperm and
    sort). hashed needs patch_size 1 and is not combined with skip_masked on a masked series
    (stored is used then). Both are deterministic, the same on every rank and after a resume."""
    patch_size: int = 1
    """Draw training rays as P x P patches of neighbouring pixels of one view (P = this value)
    instead of single pixels: a batch is batch_size / P^2 patches, each P^2 consecutive rays in row-major
    order. 1 (the default): independent pixels. Each view is tiled into a fixed grid of P x P
    tiles (the last row and column of tiles overlap their neighbours where P does not divide the
    image) and the epoch visits every tile once, in a random order; validation pixels inside a
    tile are carried with weight 0, so the train/validation split is the same as with single
    pixels. Neighbouring rays touch the same plane texels, the locality a tiled kernel needs, but
    a batch of patches carries less independent information: 4 x 4 patches needed about 1.5-2x the
    steps of single pixels at 1024 rays a step and 1.3x at 4096 (benchmarks/README.md), and no
    kernel uses the locality yet. batch_size must be a multiple of P^2."""

    def __post_init__(self) -> None:
        _choice(self.kind, ("device",) if type(self) is SamplerConfig else ("dataloader",), "sampler.kind")
        _require(self.batch_size is None or (isinstance(self.batch_size, int) and self.batch_size >= 1),
                 "sampler.batch_size", f"must be an integer >= 1 or null (automatic), got {self.batch_size!r}.")
        _require(isinstance(self.patch_size, int) and not isinstance(self.patch_size, bool) and 1 <= self.patch_size <= 64,
                 "sampler.patch_size", f"must be an integer in [1, 64] (1: single pixels), got {self.patch_size!r}.")
        p2 = self.patch_size * self.patch_size
        _require(self.batch_size is None or self.batch_size % p2 == 0,
                 "sampler.batch_size", f"{self.batch_size} rays is not a whole number of {self.patch_size} x "
                 f"{self.patch_size} patches (sampler.patch_size); use a multiple of {p2}, e.g. "
                 f"{max(p2, (self.batch_size or 0) // p2 * p2)}.")
        _require(0 <= self.val_fraction < 0.5, "sampler.val_fraction",
                 f"must be in [0, 0.5), got {self.val_fraction!r}.")
        _require(isinstance(self.skip_masked, bool), "sampler.skip_masked",
                 f"must be true or false, got {self.skip_masked!r}.")
        _require(self.order in (None, "stored", "hashed"), "sampler.order",
                 f"must be stored, hashed or null (automatic), got {self.order!r}.")
        _require(self.order != "hashed" or self.patch_size == 1, "sampler.order",
                 f"hashed draws single pixels; with sampler.patch_size={self.patch_size} use sampler.order=stored "
                 "(or null).")


@dataclasses.dataclass
class DataLoaderSamplerConfig(SamplerConfig):
    """sampler=dataloader: the per-pixel torch DataLoader path (kept for comparison)."""

    kind: str = "dataloader"
    num_workers: int = 0
    """DataLoader worker processes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(isinstance(self.num_workers, int) and self.num_workers >= 0, "sampler.num_workers",
                 f"must be an integer >= 0, got {self.num_workers!r}.")


SamplerConfig._selector, SamplerConfig._group = "kind", "sampler"
SamplerConfig._options = {"device": SamplerConfig, "dataloader": DataLoaderSamplerConfig}


# --------------------------------------------------------------------------------------- optim
@dataclasses.dataclass
class OptimConfig:
    steps: Optional[int] = None
    """Number of optimizer steps (the total, over resumes). None: from the image size
    (``run.build.auto_steps``): 1500 up to 256 pixels a side (the embedded phantom, 128^2 series),
    plus 2000 per doubling of the largest side above (5500 at 1024, 7500 at 2048); for a K-Planes
    field times 2 on a dose-limited series (estimated per-pixel signal-to-noise at most 0.6, 1 at
    1.3 or more, linear in the log of the estimate between: ``models.regularizers.steps_factor_for``)."""
    lr_grids: float = 3e-2
    """Adam learning rate of the plane / voxel parameters (3e-2, with the plane TV weight loss.plane_tv chooses from the
    data: bench_quality found it better than 2e-2 and 3e-3 on every case it ran, at the same fit
    time; benchmarks/README.md)."""
    lr_decoder: float = 5e-3
    """Adam learning rate of the decoder MLP."""
    lr_rotations: float = 1e-3
    """Adam learning rate of the TILTED frame rotations."""
    lr_pose_rotations: float = 1e-3
    """Adam learning rate of the per-tilt in-plane rotations z3 (and z1) (radians: Adam moves a
    parameter by about this much per step, so 1e-3 is 0.057 degrees per step; the schedule's decay
    takes it to a few thousandths of a degree at the end). At 1e-4 a +-1 degree error was still
    being corrected when a 1000-step fit ended (bench_quality pose128: 0.190 degree RMS at 1e-4,
    0.116 at 3e-4, 0.089 at 1e-3)."""
    lr_pose_shifts: float = 2e-2
    """Adam learning rate of the per-tilt image shifts (pixels: about this many pixels per step).
    Shifts and rotations get their own rates because their units differ: one rate for both either
    freezes the shifts or throws the rotations around."""
    lr_intensity: float = 1e-3
    """Adam learning rate of the intensity model (background offsets, per-view gains), in the
    sampler's normalized units."""
    betas: list = dataclasses.field(default_factory=lambda: [0.9, 0.99])
    """[beta1, beta2] of Adam."""
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
        _require(self.steps is None or (isinstance(self.steps, int) and self.steps >= 1), "optim.steps",
                 f"must be an integer >= 1 (or null: from the image size), got {self.steps!r}.")
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
class ScheduleConfig(GroupOption):
    """The ``schedule`` group: constant (this class), cosine and exponential
    (:class:`DecayScheduleConfig`) or plateau (:class:`PlateauScheduleConfig`)."""

    kind: str = "cosine"
    """Learning-rate schedule: constant, cosine, exponential or plateau."""
    warmup_steps: int = 0
    """Linear warm-up from 0 over this many steps (combines with every kind)."""

    def __post_init__(self) -> None:
        _choice(self.kind, tuple(k for k, c in self._options.items() if c is type(self)), "schedule.kind")
        _require(isinstance(self.warmup_steps, int) and self.warmup_steps >= 0, "schedule.warmup_steps",
                 f"must be an integer >= 0, got {self.warmup_steps!r}.")


@dataclasses.dataclass
class DecayScheduleConfig(ScheduleConfig):
    """schedule=cosine and schedule=exponential: decay from 1 to min_factor over the run."""

    min_factor: float = 0.05
    """The factor reached at the last step."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(0 < self.min_factor <= 1, "schedule.min_factor", f"must be in (0, 1], got {self.min_factor!r}.")


@dataclasses.dataclass
class PlateauScheduleConfig(ScheduleConfig):
    """schedule=plateau: cut the rate when the validation loss stops falling."""

    kind: str = "plateau"
    plateau_patience: int = 5
    """Validation checks without improvement before the rate is cut."""
    plateau_factor: float = 0.5
    """Multiply the rate by this on a plateau."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _require(isinstance(self.plateau_patience, int) and self.plateau_patience >= 0, "schedule.plateau_patience",
                 f"must be an integer >= 0, got {self.plateau_patience!r}.")
        _require(0 < self.plateau_factor < 1, "schedule.plateau_factor",
                 f"must be in (0, 1), got {self.plateau_factor!r}.")


ScheduleConfig._selector, ScheduleConfig._group = "kind", "schedule"
ScheduleConfig._options = {"constant": ScheduleConfig, "cosine": DecayScheduleConfig,
                           "exponential": DecayScheduleConfig, "plateau": PlateauScheduleConfig}


# --------------------------------------------------------------------------------------- loss
@dataclasses.dataclass
class LossConfig:
    kind: str = "mse"
    """Data term: mse, l1 or huber (see src/fasttomo/methods/field/losses.py)."""
    huber_delta: float = 0.05
    """huber: the error (in units of the normalized targets, whose 99.9 % quantile is 1) where the
    loss turns from quadratic to linear."""
    s3im: float = 0.0
    """Weight of the S3IM term (stochastic structural similarity over random groups of the batch's
    rays, added to the data term; 0 turns it off)."""
    plane_tv: float | None = None
    """Weight of the plane total variation (K-Planes planes). None: chosen from the data when the
    run is built (``models.regularizers.plane_tv_for``): 3e-2 where the estimated per-pixel
    signal-to-noise is at least 1.3, 1 for a dose-limited series (0.6 or less), log-linear between;
    optim.lr_grids 3e-2 goes with all."""
    plane_tv_hold: float = 0.0
    """Fraction of the steps during which a plane TV above 3e-2 is held at 3e-2 (the structure
    forms under the light weight before the smoothing; ``models.regularizers.PlaneTVSchedule``)."""
    plane_tv_ramp: float = 0.0
    """Fraction of the steps, after the hold, over which the plane TV rises linearly from 3e-2 to
    loss.plane_tv (0 with a hold: a step at its end)."""
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
        if self.plane_tv is not None:
            _nonneg(self.plane_tv, "loss.plane_tv")
        for key in ("plane_tv_hold", "plane_tv_ramp"):
            v = getattr(self, key)
            _require(0.0 <= v <= 1.0, f"loss.{key}", f"must be a fraction of the steps in [0, 1], got {v!r}.")
        _require(self.plane_tv_hold + self.plane_tv_ramp <= 1.0, "loss.plane_tv_hold + loss.plane_tv_ramp",
                 f"must be at most 1 (the whole run), got {self.plane_tv_hold!r} + {self.plane_tv_ramp!r}; "
                 "lower one of them.")
        _nonneg(self.volume_tv, "loss.volume_tv")
        _choice(self.volume_tv_kind, ("squared", "l1"), "loss.volume_tv_kind")
        _require(isinstance(self.volume_tv_points, int) and self.volume_tv_points >= 2, "loss.volume_tv_points",
                 f"must be an integer >= 2, got {self.volume_tv_points!r}.")


# --------------------------------------------------------------------------------------- precision
@dataclasses.dataclass
class PrecisionConfig:
    dtype: str = "auto"
    """Autocast dtype of the field: auto (bf16 on a CUDA device that supports it, bf16 for the decoder's
    layers on a CPU with bf16 dot-product instructions, else fp32), fp32,
    bf16 or fp16 (fp16 uses a GradScaler). Rays, rotations and the line integral always run in
    fp32. bench_quality measured no quality difference between fp32 and bf16 fields (128^3,
    clean and 5 % noise) and bf16 steps are faster on the GPU; on a CPU bf16 speeds up the
    decoder's matrix products only (docs/quality.md)."""
    planes: str = "fp32"
    """What the interpolation samples the K-Planes from: fp32 (the parameters themselves) or bf16 (a
    copy rounded to bf16 each step: half the bytes the fused GPU kernels gather; the parameters,
    their gradients and Adam stay fp32, and every sum after the read is fp32). The CPU paths sample
    the same rounded values. On an H200 the flagship's bf16 step takes 4.9 % less (the interpolation's
    forward 14-23 % less), small problems gain nothing; no quality cost measured (docs/kernels.md,
    "bf16 planes")."""

    def __post_init__(self) -> None:
        _choice(self.dtype, ("auto", "fp32", "bf16", "fp16"), "precision.dtype")
        _choice(self.planes, ("fp32", "bf16"), "precision.planes")


# --------------------------------------------------------------------------------------- kernels
@dataclasses.dataclass
class KernelsConfig:
    backend: str = "auto"
    """auto (fused Triton kernels on CUDA, native C kernels on a CPU, where valid; else pure torch),
    triton (require them) or torch."""
    gpu_decoder: str = "fused"
    """The hybrid decoder in bf16 training on a GPU: fused (two Triton kernels that keep its
    activations in registers, for model.hidden 16, 32 or 64, after cuBLAS's first product where
    the features are more than 64: the camera2k step 10.8 ms against 14.0 with cublas on an H100,
    the flagship's 29.45 against 30.71, the same quality; docs/kernels.md, "The camera step") or
    cublas (torch's GEMMs and elementwise kernels). fp32 and fp16 runs, other hidden widths and
    kernels.backend=torch use cuBLAS either way."""
    step_fusion: bool = True
    """On a GPU, two fusions of the training step (docs/kernels.md, "The door"): the rays' samples
    in one kernel, and the features' and plane TV's backward into one buffer (the camera2k bf16
    step 10.11 ms against 10.83 without on an H100). The same computation either way: the samples
    are the twin's bits, the plane gradients differ by the order of their sums. false: the
    separate ops."""

    def __post_init__(self) -> None:
        _choice(self.backend, ("auto", "triton", "torch"), "kernels.backend")
        _choice(self.gpu_decoder, ("cublas", "fused"), "kernels.gpu_decoder")


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
    val_every: Optional[int] = None
    """Validation loss (fp32) every N steps; null: every max(100, 50 x ceil(optim.steps / 1250))
    steps (100 up to 1250 steps; about 25 checks in longer runs, so a camera-sized run spends no
    more of its time validating than a short one)."""
    image_every: int = 200
    """Central-slice images to TensorBoard every N steps (0: only at the end)."""
    tensorboard: bool = True
    """Write TensorBoard events under <run>/tb."""
    progress: bool = True
    """Show a tqdm progress bar with ETA when stderr is a terminal (a redirected output gets a
    progress line every tenth of the run instead, without carriage returns; reconstruct.log always
    gets those lines)."""
    checkpoint_every: int = 0
    """Write a checkpoint every N steps as checkpoints/step<N>.pt, N zero-padded to 7 digits
    (0: only checkpoints/last.pt at the end)."""
    all_ranks: bool = False
    """Under torchrun: every process logs, each line prefixed with its rank (default: rank 0
    alone logs; the others print errors only)."""

    def __post_init__(self) -> None:
        for name in ("log_every", "val_every"):
            v = getattr(self, name)
            _require((v is None and name == "val_every") or (isinstance(v, int) and v >= 1), f"logging.{name}",
                     f"must be an integer >= 1{' or null (sized from optim.steps)' if name == 'val_every' else ''}, "
                     f"got {v!r}.")
        for name in ("image_every", "checkpoint_every"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 0, f"logging.{name}", f"must be an integer >= 0, got {v!r}.")
        _require(isinstance(self.all_ranks, bool), "logging.all_ranks",
                 f"must be true or false, got {self.all_ranks!r}.")


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
    the full reconstruction). Needs no ground truth. The half volumes are held for their FSC (on
    the GPU where it has room) and not written; output.half_volumes=true writes them."""
    view_residuals: bool = True
    """Predict every training view with the fit (field, learned poses, intensity model) and report
    the Pearson correlation and RMS residual per view in metrics.json: the view the others do not
    explain (a bad tilt, a stage jump) stands out. Costs one forward pass over a regular grid of
    at most about 65,000 pixels of all views together (every s-th row and column; metrics.json's
    ``pixel_stride``), so it stays cheap for large images."""

    def __post_init__(self) -> None:
        _require(isinstance(self.curve_every, int) and self.curve_every >= 0, "evaluation.curve_every",
                 f"must be an integer >= 0, got {self.curve_every!r}.")
        _require(all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in self.holdout_views),
                 "evaluation.holdout_views", f"must be 1-based view numbers (integers >= 1), got {self.holdout_views!r}.")
        _require(isinstance(self.half_sets, bool), "evaluation.half_sets",
                 f"must be true or false, got {self.half_sets!r}.")
        _require(isinstance(self.view_residuals, bool), "evaluation.view_residuals",
                 f"must be true or false, got {self.view_residuals!r}.")


# --------------------------------------------------------------------------------------- output
@dataclasses.dataclass
class OutputConfig:
    dir: Optional[str] = None
    """Run folder. Set by the entry point from Hydra's run dir. A folder holding another run's
    results is refused (see overwrite); one holding only a failed run's files is reused."""
    volume_shape: Optional[list] = None
    """[Z, Y, X] of the exported volume; None: the reconstruction box at pixel sampling."""
    formats: list = dataclasses.field(default_factory=lambda: ["mrc"])
    """Volume files to write: any of mrc, h5, tiff (e.g. [mrc, h5] for HDF5 too). With mrc, a
    field's volume is evaluated and written slab by slab into volume.mrc, never whole in memory."""
    slab_planes: Optional[int] = None
    """Z planes of the volume evaluated and written at a time; None: sized from the free memory
    of the device and the host (a quarter of the smaller)."""
    imod_xzy: bool = False
    """Also write the volume in IMOD's un-rotated XZY orientation (as before trimvol -rx)."""
    half_volumes: bool = False
    """Fit the even and the odd views apart and write the two half tomograms volume_even.mrc and
    volume_odd.mrc (the full volume's header and orientation; also in the other output.formats)
    for denoisers (cryoCARE, IsoNet, DeepDeWedge); their FSC goes into report.png and
    metrics.json half_sets, as with evaluation.half_sets=true."""
    overwrite: bool = False
    """Replace the results of an earlier run in the folder: every file that run wrote (listed in
    its manifest.json) is removed before anything is written. Other files are kept."""

    def __post_init__(self) -> None:
        _require(isinstance(self.formats, (list, tuple)) and len(self.formats) > 0, "output.formats",
                 f"names no volume file ({self.formats!r}), so the run would write no reconstruction; give at least "
                 "one of mrc, h5, tiff, e.g. output.formats=[mrc].")
        for f in self.formats:
            _choice(f, ("mrc", "h5", "tiff"), "output.formats[]")
        if self.slab_planes is not None and self.slab_planes < 1:
            raise ConfigError(f"output.slab_planes={self.slab_planes}: must be >= 1, or null to size the slabs "
                              "from the free memory.")


@dataclasses.dataclass
class Config:
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    pose: PoseConfig = dataclasses.field(default_factory=PoseConfig)
    projector: ProjectorConfig = dataclasses.field(default_factory=ProjectorConfig)
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

    def __post_init__(self) -> None:
        if self.precision.planes != "fp32" and self.model.kind != "kplanes_tilted":
            raise ConfigError(f"precision.planes={self.precision.planes}: model.kind={self.model.kind} has no planes to "
                              "sample; remove precision.planes or use model=kplanes_tilted (or model=kplanes).")


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


def _readers(base: type, key: str) -> list:
    """The selector values of the options of group ``base`` that read ``key``."""
    return [v for v, c in base._options.items() if key in option_keys(c)]


def from_dict(cls: type, data: dict | None, prefix: str = "") -> Any:
    """Build dataclass ``cls`` from a plain dict, rejecting unknown keys and wrong types. For a
    group with options (:class:`GroupOption`) the option is chosen by its selector key, and a key
    that option does not read is an error naming the key, the option and the keys it has."""
    data = dict(data or {})
    where = prefix.rstrip(".") or "config"
    if isinstance(cls, type) and issubclass(cls, GroupOption):
        base = cls.group_base()
        sel = data.get(base._selector, base._default_option())
        _choice(sel, tuple(base._options), f"{where}.{base._selector}")
        cls = base._options[sel]
        keys = option_keys(cls)
        unread = [k for k in data if k not in keys]
        if unread:
            k = unread[0]
            readers = _readers(base, k)
            also = (f" (it is read by {where}.{base._selector}={'|'.join(map(_yaml_str, readers))})" if readers
                    else " (no option of this group has it: check the spelling)")
            raise ConfigError(
                f"{where}.{k}: {where}.{base._selector}={_yaml_str(sel)} does not read this key{also}; the keys of "
                f"{where}.{base._selector}={_yaml_str(sel)} are {keys}. Remove {where}.{k}, or choose an option "
                "that reads it.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
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


def _yaml_str(v: Any) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


# --------------------------------------------------------------------------------------- Hydra's view
UNSET = "???"
"""Hydra's schema gives every key this value (omegaconf's MISSING): a key no YAML file and no
command-line item sets is left out of the dict handed to :func:`from_dict`, so its default comes
from the option's dataclass, the one place defaults live."""


def group_option_classes(tp: type) -> list[type]:
    """The dataclasses a group field of type ``tp`` can hold (all its options, or ``tp`` itself)."""
    if isinstance(tp, type) and issubclass(tp, GroupOption):
        return tp.option_classes()
    return [tp]


def hydra_schema(cls: type, _name: str = "") -> type:
    """A dataclass for Hydra's ConfigStore with every key of every option of every group of
    ``cls`` (so any of them can be set from the command line and a misspelled key is refused by
    Hydra at once), each defaulting to :data:`UNSET` (so the YAML files hold only what differs
    from the dataclass defaults). Which keys the chosen option reads is checked by
    :func:`from_dict`. Needs no omegaconf: the entry points register the result."""
    fields: dict[str, tuple] = {}
    for klass in group_option_classes(cls):
        hints = typing.get_type_hints(klass)
        for f in dataclasses.fields(klass):
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                sub = hydra_schema(tp, f"{_name}{f.name.title()}")
                fields[f.name] = (f.name, sub, dataclasses.field(default_factory=sub))
                continue
            tp = tp if typing.get_origin(tp) in (Union, types.UnionType) else Optional[tp]
            if f.name in fields and fields[f.name][1] != tp:
                tp = Any
            fields[f.name] = (f.name, tp, dataclasses.field(default=UNSET))
    return dataclasses.make_dataclass(f"{_name or cls.__name__}Schema", list(fields.values()))


def strip_unset(data: Any) -> Any:
    """``data`` without the keys Hydra's schema left at :data:`UNSET` (nested dicts too). A nested
    section left with no key at all (``data.particle`` of a file source: nothing set it) goes too,
    so an option that does not read the section is not told it was set."""
    if not isinstance(data, dict):
        return data
    out = {}
    for k, v in data.items():
        if isinstance(v, str) and v == UNSET:
            continue
        if isinstance(v, dict) and v:
            v = strip_unset(v)
            if not v:
                continue
        out[k] = v
    return out


# --------------------------------------------------------------------------------------- older configs
MOVED_KEYS = {"sampler.samples_per_ray": "projector.samples_per_ray", "model.learn_rotations": "model.learn_frames"}
"""Keys renamed or moved since configs were first stored in checkpoints: old name -> new name."""


def upgrade(saved: dict) -> dict:
    """A config dict stored by an older fasttomo (a checkpoint's), in today's shape: moved keys
    (:data:`MOVED_KEYS`) under their new names, and the keys its group options never read dropped
    (those runs ignored them: a phantom's ``data.binning``, a voxel model's ``channels``). Keys of
    today's options that it lacks take their defaults when it is built, except ``pose.learn_z1``
    and ``pose.learn_tilt_axis`` of a refined run, which take that run's behaviour (true, false)."""
    import copy

    out = copy.deepcopy(saved)
    for old, new in MOVED_KEYS.items():
        g_old, k_old = old.split(".")
        g_new, k_new = new.split(".")
        group = out.get(g_old)
        if isinstance(group, dict) and k_old in group:
            value = group.pop(k_old)
            target = out.setdefault(g_new, {})
            if isinstance(target, dict):
                target.setdefault(k_new, value)
    pose = out.get("pose")
    if isinstance(pose, dict) and pose.get("learn") is True:
        if "learn_z1" not in pose:
            pose["learn_z1"] = True  # a checkpoint without learn_z1 refined z1 with every rotation
        if "learn_tilt_axis" not in pose:
            pose["learn_tilt_axis"] = False  # no common rotation was learned then
    hints = typing.get_type_hints(Config)
    for name, tp in hints.items():
        group = out.get(name)
        if not (isinstance(group, dict) and isinstance(tp, type) and issubclass(tp, GroupOption)):
            continue
        base = tp.group_base()
        sel = group.get(base._selector, base._default_option())
        if sel in base._options:
            keys = option_keys(base._options[sel])
            out[name] = {k: v for k, v in group.items() if k in keys}
    return out


def to_dict(cfg: Any) -> dict:
    """A plain, JSON/YAML-serializable dict of a config dataclass."""
    return dataclasses.asdict(cfg)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    """A nested dict as dotted keys ({"optim": {"steps": 5}} -> {"optim.steps": 5}); an empty dict
    stays one key."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def tool_device(name: str, error: type = ConfigError):
    """The torch device of a tool's ``device=`` key (auto | cpu | cuda | cuda:N): auto is the GPU
    when torch sees one; a CUDA device torch cannot see raises ``error`` naming the fix."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise error(f"device={name}: torch sees no GPU here; use device=cpu or device=auto.")
    return torch.device(name)
