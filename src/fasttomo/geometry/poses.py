"""Per-tilt projection poses (tilt angle fixed, in-plane rotations and shifts optionally learned).

Detector coordinates of a volume point p = (x, y, z) (centred, voxel units) seen in view n:

    (u, v, w) = Rz(z3[n]) @ Ry(theta[n]) @ Rz(z1[n]) @ p + (su[n], sv[n], 0)

with ``Ry``/``Rz`` from :mod:`fasttomo.geometry.so3` (IMOD convention: at z1 = z3 = 0 and no
shift, u = x cos(theta) + z sin(theta), v = y). theta comes from the data (degrees at the surface,
a buffer in radians here), optionally one angle per image line (continuous-rotation data,
``angles_deg`` of shape (N, H)). z1, z3 (radians) and the shifts (pixels) are parameters, all
starting at zero; the reference view (smallest |angle|) is multiplied by a zero mask, so its
values have no effect and receive zero gradient, except its shift where ``free_reference_shift``
opens it (a gauge, reported in the frame where it is zero). One more rotation, ``axis`` (radians),
is added to every view's z3, the reference's included: an error of the tilt-axis angle. It is
learned with ``learn_tilt_axis`` when z1 is not (with z1 it would be an exact gauge: the volume
turned about z and every z1 moved); the tilted views fix it. One shared parameter, not a free
reference z3: the common rotation is the slow direction of the fit (the field can turn to follow
it), and one parameter fed by every view's gradient moves along it faster. Everything is a
registered parameter or buffer, so ``.to(device)`` moves the state and never re-initializes it.
Rotation math runs in fp32 with autocast disabled.

Initial poses (``initial``: a pose dict, e.g. an IMOD or AreTomo alignment read by
:mod:`fasttomo.data.io.alignment`) are fixed buffers ``base_z1``, ``base_z3``, ``base_shifts``
that every view's pose starts from, the reference view's included; what is learned (and masked,
and reported as a gauge) is the correction added to them:

    z1 = base_z1 + z1' m,  z3 = base_z3 + z3' m + axis,  shifts = base_shifts + shifts' m_s.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from fasttomo.geometry.so3 import rot_y, rot_z


class Poses(torch.nn.Module):
    def __init__(self, angles_deg: np.ndarray, reference_index: int, learn_rotations: bool = False,
                 learn_shifts: bool = False, learn_z1: bool = True, free_reference_shift: bool = False,
                 learn_tilt_axis: bool = False, initial: dict | None = None) -> None:
        """``learn_rotations`` learns z3 and, with ``learn_z1``, z1; ``free_reference_shift`` (with
        ``learn_shifts``) learns the reference view's shift too; ``learn_tilt_axis`` (with
        ``learn_rotations``, without ``learn_z1``) learns the rotation common to every view;
        ``initial`` (z1_deg, z3_deg, shift_u_px, shift_v_px per view) sets the poses the learned
        corrections start from (module docstring)."""
        super().__init__()
        angles = np.asarray(angles_deg, dtype=np.float64)
        if angles.ndim not in (1, 2) or angles.shape[0] < 1:
            raise ValueError(f"Poses: angles_deg must be (N,) or (N, H), got shape {angles.shape}")
        n = angles.shape[0]
        if not 0 <= reference_index < n:
            raise ValueError(f"Poses: reference_index {reference_index} outside [0, {n})")
        self.n_views = n
        self.reference_index = int(reference_index)
        self.learn_rotations = bool(learn_rotations)
        self.learn_shifts = bool(learn_shifts)
        self.register_buffer("theta", torch.from_numpy(np.deg2rad(angles)).float())
        self._given_deg = angles.copy()  # theta is a buffer (never learned): the angles as given, not float32's
        mask = torch.ones(n)
        mask[reference_index] = 0.0
        self.register_buffer("free_mask", mask)
        self.free_reference_shift = bool(free_reference_shift and learn_shifts)
        # not persistent: checkpoints of either kind load into either kind
        self.register_buffer("shift_mask", torch.ones(n) if self.free_reference_shift else mask.clone(),
                             persistent=False)
        self.learn_tilt_axis = bool(learn_tilt_axis and learn_rotations and not learn_z1)
        self.z1 = torch.nn.Parameter(torch.zeros(n), requires_grad=self.learn_rotations and bool(learn_z1))
        self.z3 = torch.nn.Parameter(torch.zeros(n), requires_grad=self.learn_rotations)
        self.shifts = torch.nn.Parameter(torch.zeros(n, 2), requires_grad=self.learn_shifts)
        self.axis = torch.nn.Parameter(torch.zeros(()), requires_grad=self.learn_tilt_axis)
        base = _initial_arrays(initial, n)
        self.register_buffer("base_z1", torch.from_numpy(np.deg2rad(base["z1_deg"])).float())
        self.register_buffer("base_z3", torch.from_numpy(np.deg2rad(base["z3_deg"])).float())
        self.register_buffer("base_shifts", torch.from_numpy(
            np.stack((base["shift_u_px"], base["shift_v_px"]), -1)).float())
        self._table: tuple[torch.Tensor, torch.Tensor] | None = None  # see _fixed_table
        self._table_key: tuple | None = None

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs) -> None:
        # checkpoints from before the tilt-axis rotation existed: it was zero
        if prefix + "axis" not in state_dict:
            state_dict = {**state_dict, prefix + "axis": torch.zeros((), device=self.axis.device)}
        # checkpoints from before the initial poses existed: keep the module's own (built from the config)
        missing = {prefix + k: getattr(self, k) for k in ("base_z1", "base_z3", "base_shifts")
                   if prefix + k not in state_dict}
        if missing:
            state_dict = {**state_dict, **missing}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    @property
    def per_line(self) -> bool:
        return self.theta.dim() == 2

    def _effective(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m = self.free_mask
        return (self.base_z1 + self.z1 * m, self.base_z3 + self.z3 * m + self.axis,
                self.base_shifts + self.shifts * self.shift_mask.unsqueeze(-1))

    @torch.no_grad()
    def gauge_translation(self) -> torch.Tensor:
        """(3,) fp32 volume translation t (voxels, xyz) that brings the reference view's learned
        shift to zero: t = R_ref^T (su_ref, sv_ref, 0). Zeros unless ``free_reference_shift``."""
        ref = self.reference_index
        if not self.free_reference_shift:
            return torch.zeros(3, device=self.shifts.device)
        with torch.autocast(device_type=self.theta.device.type, enabled=False):
            theta = self.theta[ref].mean().reshape(1)
            # the reference view's z1 is its initial one (the correction is masked); its z3 the initial one
            # plus the common (tilt-axis) rotation
            z3 = (self.base_z3[ref] + self.axis.detach()).float().reshape(1)
            r = (rot_z(z3) @ rot_y(theta) @ rot_z(self.base_z1[ref].float().reshape(1)))[0]
            s = torch.cat((self.shifts[ref].float(), self.shifts.new_zeros(1)))
            return r.t() @ s

    @torch.no_grad()
    def _reported_shifts(self) -> torch.Tensor:
        """(N, 2) shifts in the frame where the reference shift is zero: s_n - P R_n t."""
        z1, z3, shifts = self._effective()
        if not self.free_reference_shift:
            return shifts
        theta = self.theta if not self.per_line else self.theta.mean(dim=1)
        r = rot_z(z3) @ rot_y(theta) @ rot_z(z1)
        out = shifts - (r @ self.gauge_translation())[:, :2]
        out[self.reference_index] = self.base_shifts[self.reference_index]
        return out

    def forward(self, tilt: torch.Tensor, row: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotation (B, 3, 3) and detector shift (B, 2) = (su, sv) of views ``tilt`` (B,).

        ``row`` (B,) selects the per-line angle for (N, H) angles; ignored otherwise.
        """
        if self.per_line and row is None:
            raise ValueError("Poses: per-line angles need the image row of every ray")
        table = self._fixed_table()
        if table is not None:  # nothing learned: two lookups instead of the rotation math
            r_all, s_all = table
            return (r_all[tilt, row] if self.per_line else r_all[tilt]), s_all[tilt]
        with torch.autocast(device_type=self.theta.device.type, enabled=False):
            theta = self.theta[tilt, row] if self.per_line else self.theta[tilt]
            z1, z3, shifts = self._effective()
            r = rot_z(z3[tilt]) @ rot_y(theta) @ rot_z(z1[tilt])
            return r, shifts[tilt]

    @torch.no_grad()
    def _fixed_table(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every view's rotation ((N, 3, 3), or (N, H, 3, 3) per line) and shift (N, 2) when no
        pose parameter is learned, else None. Kept between calls and recomputed when a parameter or
        buffer changed (in place: its version counter; or moved: its storage), into the same
        tensors where the shapes allow, so a captured CUDA graph reading them sees the update."""
        tensors = (self.theta, self.z1, self.z3, self.shifts, self.axis, self.free_mask, self.shift_mask,
                   self.base_z1, self.base_z3, self.base_shifts)
        if any(t.requires_grad for t in tensors):
            return None
        key = tuple((t.data_ptr(), t._version) for t in tensors)
        if self._table is not None and self._table_key == key:
            return self._table
        with torch.autocast(device_type=self.theta.device.type, enabled=False):
            z1, z3, shifts = self._effective()
            if self.per_line:
                r = rot_z(z3)[:, None] @ rot_y(self.theta) @ rot_z(z1)[:, None]
            else:
                r = rot_z(z3) @ rot_y(self.theta) @ rot_z(z1)
        old = self._table
        if old is not None and old[0].shape == r.shape and old[0].device == r.device:
            old[0].copy_(r)
            old[1].copy_(shifts)
        else:
            self._table = (r, shifts.clone())
        self._table_key = key
        return self._table

    def angles_deg(self) -> np.ndarray:
        """The tilt angles in degrees, (N,) or (N, H), as given (float64: poses.tlt writes them)."""
        return self._given_deg.copy()

    @torch.no_grad()
    def describe(self) -> dict:
        """Per-view pose values in user units (degrees, pixels) for metrics.json (host sync)."""
        z1, z3, _ = (t.detach().double().cpu() for t in self._effective())
        shifts = self._reported_shifts().double().cpu()
        ang = self.angles_deg()
        if ang.ndim == 2:
            ang = ang.mean(axis=1)
        deg = 180.0 / math.pi
        return {
            "reference_index": self.reference_index,
            "learn_rotations": self.learn_rotations,
            "learn_shifts": self.learn_shifts,
            "learn_z1": bool(self.z1.requires_grad),
            "learn_tilt_axis": self.learn_tilt_axis,
            "tilt_deg": [float(a) for a in ang],
            "z1_deg": (z1 * deg).tolist(),
            "z3_deg": (z3 * deg).tolist(),
            "shift_u_px": shifts[:, 0].tolist(),
            "shift_v_px": shifts[:, 1].tolist(),
            # how far the poses moved from where they started (the initial poses, or zero)
            "max_abs_inplane_deg": float((((z1 - self.base_z1.double().cpu()).abs()
                                           + (z3 - self.base_z3.double().cpu()).abs()) * deg).max()),
            "max_abs_shift_px": float((shifts - self.base_shifts.double().cpu()).abs().max()),
            "tilt_axis_deg": float(self.axis.detach().double().cpu()) * deg,
        }


def _initial_arrays(initial: dict | None, n: int) -> dict[str, np.ndarray]:
    """The per-view initial poses of ``initial`` (zeros where absent) as (n,) float64 arrays."""
    out = {}
    for k in ("z1_deg", "z3_deg", "shift_u_px", "shift_v_px"):
        a = np.asarray((initial or {}).get(k, np.zeros(n)), dtype=np.float64)
        if a.shape != (n,) or not np.all(np.isfinite(a)):
            raise ValueError(f"Poses: initial[{k!r}] must be {n} finite numbers (one per view), got shape {a.shape}.")
        out[k] = a
    return out
