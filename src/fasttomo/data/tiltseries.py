"""The validated tilt-series container every reader produces and every consumer takes.

Conventions (see README "Geometry conventions"):
  * ``stack`` is (n_tilts, H, W) float32. Rows (H) run along the tilt axis (IMOD's Y after
    alignment), columns (W) along X. A point (x, y, z) of the centred volume projects at tilt
    angle theta to column u = x cos(theta) + z sin(theta) and row v = y.
  * ``angles`` are in degrees, shape (n_tilts,) or, for continuous-rotation data, (n_tilts, H)
    (one angle per image line).
  * ``pixel_size`` is in Angstrom.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from fasttomo.data.views import map_views


class TiltSeriesError(ValueError):
    """Raised for a tilt series that cannot be used; the message names the problem and the fix."""


@dataclasses.dataclass
class TiltSeries:
    stack: np.ndarray
    """(n_tilts, H, W) float32 projections; rows run along the tilt axis."""
    angles: np.ndarray
    """Tilt angles in degrees: (n_tilts,) or (n_tilts, H) for per-line (continuous-rotation) data."""
    pixel_size: float = 1.0
    """Pixel size in Angstrom (also the voxel size of the reconstruction)."""
    source: str = "<memory>"
    """Where the data came from (file path or 'phantom'); used in error messages and metadata."""
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Free-form, JSON-serializable facts about the data (acquisition, preparation steps...)."""
    ground_truth: np.ndarray | None = None
    """Optional (Z, H, W) float32 ground-truth volume (synthetic data), same X/Y sampling as stack."""
    valid: np.ndarray | None = None
    """Optional (n_tilts, H, W) bool validity mask: False marks pixels to ignore in the loss
    (NaN/Inf pixels with data.nonfinite=mask, corners left empty by a tilt-axis rotation). Those
    pixels hold a finite fill value in ``stack``. None means every pixel is valid."""

    def __post_init__(self) -> None:
        self.stack = np.asarray(self.stack)
        self.angles = np.asarray(self.angles, dtype=np.float64)
        where = f"tilt series from {self.source}"
        if self.stack.ndim != 3:
            raise TiltSeriesError(
                f"{where}: stack must be 3-D (n_tilts, H, W), got shape {self.stack.shape}; "
                "give a stack of 2-D images (a single image is not a tilt series)."
            )
        if not np.issubdtype(self.stack.dtype, np.number) or np.iscomplexobj(self.stack):
            raise TiltSeriesError(f"{where}: stack dtype {self.stack.dtype} is not a real number type.")
        self.stack = np.ascontiguousarray(self.stack, dtype=np.float32)
        n, h, w = self.stack.shape
        if n < 2 or h < 3 or w < 3:
            raise TiltSeriesError(
                f"{where}: stack shape {self.stack.shape} is too small; need at least 2 tilts of 3 x 3 pixels "
                "(the noise estimate and the sizing need a pixel with neighbours on all sides)."
            )
        if self.angles.ndim == 1:
            if self.angles.shape[0] != n:
                raise TiltSeriesError(
                    f"{where}: {self.angles.shape[0]} angles for {n} images; the angle list must have "
                    "one angle per image (check the angle file, or exclude views consistently)."
                )
        elif self.angles.ndim == 2:
            if self.angles.shape != (n, h):
                raise TiltSeriesError(
                    f"{where}: per-line angles have shape {self.angles.shape}, expected (n_tilts, H) = "
                    f"({n}, {h}) (one angle per image line)."
                )
        else:
            raise TiltSeriesError(
                f"{where}: angles must be (n_tilts,) or (n_tilts, H), got shape {self.angles.shape}."
            )
        if not np.all(np.isfinite(self.angles)):
            raise TiltSeriesError(f"{where}: angles contain NaN or Inf; fix the angle file.")
        worst = float(np.max(np.abs(self.angles)))
        if worst >= 90.0:
            raise TiltSeriesError(
                f"{where}: |tilt angle| {worst:.3f} >= 90 degrees; angles must be in degrees within "
                "(-90, 90). Were radians or a different convention given?"
            )
        if self.angles.ndim == 1:
            uniq, counts = np.unique(self.angles, return_counts=True)
            if np.any(counts > 1):
                raise TiltSeriesError(
                    f"{where}: duplicate tilt angles {uniq[counts > 1].tolist()}; each view needs its own "
                    "angle (exclude the repeated views, e.g. data.exclude_views=[...])."
                )
        if self.valid is not None:
            valid = np.asarray(self.valid)
            if valid.dtype != np.bool_ or valid.shape != self.stack.shape:
                raise TiltSeriesError(
                    f"{where}: validity mask must be a bool array of the stack's shape {self.stack.shape}, "
                    f"got {valid.dtype} {valid.shape}."
                )
            if not valid.any():
                raise TiltSeriesError(f"{where}: the validity mask marks every pixel invalid; nothing to fit.")
            self.valid = None if valid.all() else np.ascontiguousarray(valid)
        _refuse_nonfinite(self.stack, where)
        if not (isinstance(self.pixel_size, (int, float)) and math.isfinite(self.pixel_size) and self.pixel_size > 0):
            raise TiltSeriesError(
                f"{where}: pixel_size must be a positive number of Angstrom, got {self.pixel_size!r}; "
                "set data.pixel_size."
            )
        self.pixel_size = float(self.pixel_size)
        if self.ground_truth is not None:
            gt = np.ascontiguousarray(self.ground_truth, dtype=np.float32)
            if gt.ndim != 3 or gt.shape[1:] != (h, w):
                raise TiltSeriesError(
                    f"{where}: ground truth shape {gt.shape} must be (Z, H, W) with H, W = {h}, {w}."
                )
            self.ground_truth = gt

    @property
    def n_tilts(self) -> int:
        return int(self.stack.shape[0])

    @property
    def height(self) -> int:
        return int(self.stack.shape[1])

    @property
    def width(self) -> int:
        return int(self.stack.shape[2])

    @property
    def per_line_angles(self) -> bool:
        return self.angles.ndim == 2

    def let_pixels_go(self) -> None:
        """Drops this series' pixels (and its validity mask) once nothing will read them, keeping
        its shape, angles, pixel size, truth and metadata: ``stack`` becomes a read-only view of one
        NaN broadcast to the same shape (no memory; a reader would get NaN, never plausible
        values). Used by the half sets where they copy each half's views (a stack they cannot
        reorder in place): at 4096^2 x 121 the run's own 8 GB stack is not held beside them."""
        self.stack = np.broadcast_to(np.float32(np.nan), self.stack.shape)
        self.valid = None

    def reference_index(self) -> int:
        """Index of the view with the smallest |tilt angle| (its pose is held fixed)."""
        a = self.angles if self.angles.ndim == 1 else self.angles.mean(axis=1)
        return int(np.argmin(np.abs(a)))


def _refuse_nonfinite(stack: np.ndarray, where: str) -> None:
    """TiltSeriesError naming the first NaN/Inf pixel of ``stack``, if any (view by view, on
    threads: no stack-sized array)."""
    finite = map_views(lambda i: bool(np.isfinite(stack[i]).all()), len(stack), stack.size)
    for k, ok in enumerate(finite):
        if not ok:
            first = [k, *np.argwhere(~np.isfinite(stack[k]))[0].tolist()]
            count = sum(int((~np.isfinite(v)).sum()) for v in stack[k:])
            raise TiltSeriesError(
                f"{where}: stack has {count} NaN/Inf pixels (first at view, row, col = {first}); "
                "repair the data or set data.nonfinite=mask to ignore those pixels."
            )
