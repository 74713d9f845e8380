"""Regularizers of the object models (sync-free: no .item(), no host branching on values)."""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from fasttomo.config import LossConfig
from fasttomo.kernels import dispatch

SUBGRID_SIZE = (0.05, 0.25)
"""Side of the random TV sub-grid as a fraction of the box side [-1, 1] (normalized width 2)."""
SUBGRID_NOISE = 4
"""Uniform random numbers one sub-grid takes (its side and its xyz corner)."""

PLANE_TV = 3e-2
"""loss.plane_tv=null on data whose estimated per-pixel signal-to-noise is at least HIGH_SNR (and
the weight of a Projector built without a loss config)."""
PLANE_TV_LOW_SNR = 1.0
"""loss.plane_tv=null on data at or below LOW_SNR: dose-limited series want the smoother fit."""
HIGH_SNR = 1.3
LOW_SNR = 0.6
"""Measured on the H200 suite (benchmarks/README.md, "The defaults, and plane TV on the whole
suite"): the Gaussian-noise ellipsoid cases and the camera-sized cases estimate 1.33-3.8 (clean
ones far more) and fit best or equal at 3e-2; the cell and catalyst specimens at 20 and 200 e/px
estimate 0.25-0.59, and their FSC to the truth rises from 1e-2 through 3e-2, 1e-1 and 3e-1 to 1.
Between the two bounds, where no case was measured, the weight goes log-linearly from one to the
other, so that no small change of the estimate makes a large change of the weight."""


def plane_tv_for(snr: float) -> tuple[float, str]:
    """(loss.plane_tv, why) for data of estimated per-pixel signal-to-noise ``snr``
    (``fasttomo.data.noise.estimate_snr``): :data:`PLANE_TV` at or above :data:`HIGH_SNR`,
    :data:`PLANE_TV_LOW_SNR` at or below :data:`LOW_SNR`, log-linear between (two significant
    digits)."""
    if snr >= HIGH_SNR:
        return PLANE_TV, f"at least {HIGH_SNR:g}"
    if snr <= LOW_SNR:
        return PLANE_TV_LOW_SNR, f"at most {LOW_SNR:g}: a dose-limited series, the smoother fit"
    t = _low_snr_position(snr)
    weight = float(f"{math.exp((1 - t) * math.log(PLANE_TV) + t * math.log(PLANE_TV_LOW_SNR)):.2g}")
    return weight, (f"between {LOW_SNR:g} and {HIGH_SNR:g}: between {PLANE_TV:g} and {PLANE_TV_LOW_SNR:g}, "
                    "log-linear in the estimate")


DOSE_STEPS_FACTOR = 2.0
"""optim.steps=None on data at or below LOW_SNR: the size rule's steps times this (1 at or above
HIGH_SNR, linear in the log of the estimate between). Measured on the H200 suite
(benchmarks/README.md, "Steps from the data"; 9006e11): at 3000 steps against
1500 the FSC mean to the truth rose on every specimen case but cell128_d200 (0.639 / 0.591 against
0.631 / 0.613, two seeds each), and catalyst128_d200 reached 0.727 / 0.689 (2.12x / 2.01x SIRT's)."""


def _low_snr_position(snr: float) -> float:
    """0 at or above HIGH_SNR, 1 at or below LOW_SNR, linear in log(snr) between."""
    if snr >= HIGH_SNR:
        return 0.0
    if snr <= LOW_SNR:
        return 1.0
    return math.log(HIGH_SNR / snr) / math.log(HIGH_SNR / LOW_SNR)


def steps_factor_for(snr: float) -> tuple[float, str]:
    """(factor of optim.steps, why) for data of estimated per-pixel signal-to-noise ``snr``: 1 at or
    above :data:`HIGH_SNR`, :data:`DOSE_STEPS_FACTOR` at or below :data:`LOW_SNR`, linear in the
    position of log(snr) between (two significant digits). A dose-limited series carries less
    signal per ray, so its fit averages over more of them."""
    t = _low_snr_position(snr)
    factor = float(f"{1.0 + (DOSE_STEPS_FACTOR - 1.0) * t:.2g}")
    if t == 0.0:
        return factor, f"at least {HIGH_SNR:g}"
    if t == 1.0:
        return factor, f"at most {LOW_SNR:g}: a dose-limited series, more steps"
    return factor, f"between {LOW_SNR:g} and {HIGH_SNR:g}: between 1 and {DOSE_STEPS_FACTOR:g}"


@dataclasses.dataclass(frozen=True)
class PlaneTVSchedule:
    """The plane TV weight along the run (loss.plane_tv_hold, loss.plane_tv_ramp): a weight above
    :data:`PLANE_TV` is held at :data:`PLANE_TV` for the first ``hold`` of the steps, then rises
    linearly to ``weight`` over the next ``ramp`` of them. A dose-limited fit under the full weight
    from its first step can stall with the specimen's envelope alone (cell256_d20 at 96^2 on the
    CPU: foreground Pearson 0.065 after 1500 steps; benchmarks/README.md); under the light weight its
    structure forms within a few hundred steps."""

    weight: float
    hold: float = 0.0
    ramp: float = 0.0

    @property
    def varies(self) -> bool:
        return self.weight > PLANE_TV and (self.hold > 0 or self.ramp > 0)

    def phase_ends(self, total: int) -> tuple[int, int]:
        """(the first step at which the hold is over, the first at full weight) of ``total`` steps."""
        return math.ceil(self.hold * total), math.ceil((self.hold + self.ramp) * total)

    def factor(self, step: int, total: int) -> float:
        """Multiplier of ``weight`` at ``step`` (0-based) of ``total``; 1 for a constant weight."""
        if not self.varies:
            return 1.0
        frac = step / max(1, total)
        if frac < self.hold:
            return PLANE_TV / self.weight
        if self.ramp > 0 and frac < self.hold + self.ramp:
            w = PLANE_TV + (self.weight - PLANE_TV) * (frac - self.hold) / self.ramp
            return w / self.weight
        return 1.0


def _device(field: nn.Module) -> torch.device:
    return next(field.parameters()).device


def random_subgrid(n: int, generator: torch.Generator | None = None, device=None,
                   size: tuple[float, float] = SUBGRID_SIZE, noise: torch.Tensor | None = None) -> torch.Tensor:
    """(n, n, n, 3) normalized xyz of a cubic n^3 grid (index order z, y, x) with a random side
    (uniform in ``size`` times 2) at a random position fully inside [-1, 1]^3.

    Random numbers are drawn on the generator's device (pass a generator on the field's device to
    keep the step free of copies) and moved to ``device``; or given as ``noise`` (SUBGRID_NOISE
    uniform numbers in [0, 1)), which a captured CUDA-graph step reads from a static buffer.
    """
    if n < 2:
        raise ValueError(f"random_subgrid: n must be >= 2, got {n}")
    gdev = generator.device if generator is not None else device
    r = (noise if noise is not None else torch.rand(SUBGRID_NOISE, generator=generator, device=gdev)).to(device)
    side = 2.0 * (size[0] + (size[1] - size[0]) * r[0])
    lo = -1.0 + (2.0 - side) * r[1:]  # (3,) xyz corner
    return _unit_grid(n, r.device) * side + lo  # t * side + lo (a product, then a sum: the definition's floats)


_unit_grids: dict = {}


def _unit_grid(n: int, device: torch.device) -> torch.Tensor:
    """(n, n, n, 3) xyz of the unit grid (index order z, y, x; steps of linspace(0, 1, n)), made
    once per (n, device): the sub-grid is one product and sum of it a step (a captured CUDA graph
    finds it made by the eager warm-up steps)."""
    key = (n, device)
    if key not in _unit_grids:
        t = torch.linspace(0.0, 1.0, n, device=device)
        gz, gy, gx = torch.meshgrid(t, t, t, indexing="ij")
        _unit_grids[key] = torch.stack((gx, gy, gz), dim=-1)
    return _unit_grids[key]


def field_volume_tv(field: nn.Module, n: int, kind: str = "squared",
                    generator: torch.Generator | None = None, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Volume TV (``dispatch.volume_tv``) of the field's density on a random n^3 sub-grid."""
    points = random_subgrid(n, generator, _device(field), noise=noise)
    return dispatch.volume_tv(field(points), kind)


def needs_noise(field: nn.Module, loss_cfg: LossConfig) -> bool:
    """Whether :func:`regularization` draws random numbers (the field volume TV's sub-grid)."""
    return loss_cfg.volume_tv > 0 and not hasattr(field, "volume_tv")


def subgrid_points(field: nn.Module, loss_cfg: LossConfig, generator: torch.Generator | None = None,
                   noise: torch.Tensor | None = None) -> torch.Tensor | None:
    """The (n, n, n, 3) random sub-grid of the field volume TV (n = loss.volume_tv_points), or None
    when the field has no such term. A trainer evaluates the field there in the same call as the
    ray samples (one field evaluation per step) and hands the density to :func:`regularization`."""
    if not needs_noise(field, loss_cfg):
        return None
    return random_subgrid(loss_cfg.volume_tv_points, generator, _device(field), noise=noise)


def regularization(field: nn.Module, loss_cfg: LossConfig, generator: torch.Generator | None = None,
                   noise: torch.Tensor | None = None, tv_density: torch.Tensor | None = None,
                   plane_tv_scale: torch.Tensor | None = None, plane_tv: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Weighted regularization total and its weighted parts ({'plane_tv', 'volume_tv'}, only the
    terms with a positive weight that apply to the field; the parts sum to the total).

    plane TV: fields with ``plane_tv()`` (K-Planes). Volume TV: the field's own ``volume_tv``
    (voxel grid) or, for other fields, the volume TV of ``tv_density`` (the field's density on
    :func:`subgrid_points`, evaluated by the caller) or else :func:`field_volume_tv` on a random
    sub-grid drawn here. ``plane_tv_scale``: a 0-dim tensor multiplying the plane TV weight (the
    :class:`PlaneTVSchedule` factor of the step; a tensor so that a captured graph reads its update).
    ``plane_tv``: the field's plane TV computed by the caller (``field(points, plane_tv=True)``,
    whose backward takes it in one pass with the features'), else ``field.plane_tv()`` here.
    """
    parts: dict[str, torch.Tensor] = {}
    if loss_cfg.plane_tv is None:
        raise ValueError("loss.plane_tv is null (chosen from the data when a run is built: fasttomo.run.build); "
                         "give a number, e.g. LossConfig(plane_tv=3e-2), to compute the regularizers directly.")
    if loss_cfg.plane_tv > 0 and hasattr(field, "plane_tv"):
        parts["plane_tv"] = loss_cfg.plane_tv * (field.plane_tv() if plane_tv is None else plane_tv)
        if plane_tv_scale is not None:
            parts["plane_tv"] = parts["plane_tv"] * plane_tv_scale
    if loss_cfg.volume_tv > 0:
        if hasattr(field, "volume_tv"):
            tv = field.volume_tv(loss_cfg.volume_tv_kind)
        elif tv_density is not None:
            tv = dispatch.volume_tv(tv_density, loss_cfg.volume_tv_kind)
        else:
            tv = field_volume_tv(field, loss_cfg.volume_tv_points, loss_cfg.volume_tv_kind, generator, noise)
        parts["volume_tv"] = loss_cfg.volume_tv * tv
    total = None
    for v in parts.values():
        total = v if total is None else total + v
    return (torch.zeros((), device=_device(field)) if total is None else total), parts
