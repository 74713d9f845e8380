"""Scoring per-tilt poses against the truth of a synthetic series (and loading poses).

Both inputs are pose dicts in user units, per view: ``tilt_deg``, ``z1_deg``, ``z3_deg``,
``shift_u_px``, ``shift_v_px`` and ``reference_index``: the format of ``Poses.describe()`` (the
``poses`` entry of metrics.json), of ``TiltSeries.metadata["true_poses"]`` and of the
``<out>_poses.json`` written by fasttomo-simulate. The pose model is the one of
:mod:`fasttomo.geometry.poses`: view n sees the volume point p at
(u, v, w) = R_n p + (su_n, sv_n, 0) with R_n = Rz(z3_n) Ry(theta_n) Rz(z1_n).

Gauge freedoms (what the data cannot fix)
    Translating the learned volume by t (a feature at q moves to q + t) and changing every view's
    shift to s_n - P R_n t (P keeps u and v) predicts exactly the same images. fasttomo keeps the
    reference view's pose fixed (zero shift), which only allows P R_ref t = 0: t along the
    reference view's beam direction, t = -tau R_ref^T e_z. Then s_n changes by tau a_n with
    a_n = P R_n R_ref^T e_z; with no in-plane rotations and theta_ref = 0 that is the familiar
    su_n = t_z sin(theta_n) (sv unchanged). :func:`pose_errors` fits tau by least squares over
    the non-reference views and reports the shift error with and without it.

    In-plane rotations: R_n = Rz(z3) Ry(theta) Rz(z1) splits one small rotation between z1 (about
    the specimen's z, before the tilt) and z3 (about the beam, after it). At theta = 0 only z1 + z3
    is defined, and at small tilts the split is poorly conditioned, so comparing z3 alone
    penalizes a learned pose that is right but split differently. The rotation error is
    therefore the geodesic angle between the learned and the true rotation matrices,
    angle(R_L R_T^T) = atan2(|axis vector|, trace - 1): independent of how the Euler angles
    share it, and for small errors sqrt((dz1 sin theta)^2 + (dz3 + dz1 cos theta)^2). The raw z3
    difference is reported beside it for reference. There is no rotation gauge left: the fixed
    reference view pins the volume's orientation, and the tilt angles are not learned. With z1 not
    learned, a rotation common to every view may be learned too (``learn_tilt_axis``: an error of
    the tilt-axis angle turns every image, the reference's included); the tilted views fix it, and
    the reference view is then scored like the others.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from fasttomo.data.phantom import pose_rotations

__all__ = ["POSE_FIELDS", "pose_errors", "set_poses"]

POSE_FIELDS = ("tilt_deg", "z1_deg", "z3_deg", "shift_u_px", "shift_v_px")
"""The per-view lists a pose dict must hold (plus ``reference_index``)."""

_TILT_ATOL_DEG = 1e-3  # the same tilt angles, written to a file and read back (describe() gives them as given)


def _arrays(poses: Mapping[str, Any], what: str) -> dict[str, np.ndarray]:
    if not isinstance(poses, Mapping):
        raise ValueError(f"pose_errors: {what} poses must be a dict (Poses.describe() or a _poses.json), "
                         f"got a {type(poses).__name__}.")
    missing = [k for k in (*POSE_FIELDS, "reference_index") if k not in poses]
    if missing:
        raise ValueError(f"pose_errors: {what} poses lack {missing}; give the dict of Poses.describe() (metrics.json "
                         "'poses', written when pose.learn=true) or of a fasttomo-simulate _poses.json.")
    out = {k: np.asarray(poses[k], dtype=np.float64) for k in POSE_FIELDS}
    n = out["tilt_deg"].shape
    for k, a in out.items():
        if a.ndim != 1 or a.shape != n or not np.all(np.isfinite(a)):
            raise ValueError(f"pose_errors: {what} poses[{k!r}] must be finite, one number per view ({n[0]}), "
                             f"got shape {a.shape}.")
    return out


def _geodesic_deg(ra: np.ndarray, rb: np.ndarray) -> np.ndarray:
    """Angle (degrees) of ra rb^T for (..., 3, 3) rotations, accurate for small angles too."""
    d = ra @ np.swapaxes(rb, -1, -2)
    axis = np.stack((d[..., 2, 1] - d[..., 1, 2], d[..., 0, 2] - d[..., 2, 0], d[..., 1, 0] - d[..., 0, 1]), -1)
    trace = d[..., 0, 0] + d[..., 1, 1] + d[..., 2, 2]
    return np.rad2deg(np.arctan2(np.linalg.norm(axis, axis=-1), trace - 1.0))


def _rms(x: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(x)))) if x.size else 0.0


def pose_errors(learned: Mapping[str, Any], true: Mapping[str, Any]) -> dict:
    """Errors of ``learned`` poses against ``true`` ones, over the non-reference views.

    Both are pose dicts (module docstring) of the same views in the same order with the same
    reference view (checked; a ValueError says what differs). Returns a JSON-ready dict:

    * ``shift_rms_px`` / ``shift_max_px``: RMS / max over views of the length of the 2-D shift
      error (s_learned - s_true), raw;
    * ``shift_rms_px_gauge_free`` / ``shift_max_px_gauge_free``: the same after removing the best
      (least-squares) translation of the volume along the reference beam (module docstring);
    * ``gauge_translation_xyz_px``: that translation t (x, y, z voxels; the learned volume sits at
      +t relative to the truth), ``gauge_tau_px`` its signed length along the reference beam
      direction R_ref^T e_z (for theta_ref = 0: t = (0, 0, t_z), learned su_n = true su_n - t_z sin theta_n);
    * ``rotation_rms_deg`` / ``rotation_max_deg``: geodesic angle between the learned and true
      rotations R_n (module docstring), the in-plane rotation error that does not depend on the
      z1/z3 split;
    * ``rotation_z3_rms_deg``: raw RMS of the z3 difference alone (wrapped to +-180);
    * ``n_rotations_compared``: views in the rotation figures: the non-reference views, and the
      reference view when either pose turns it (a tilt-axis error, ``learn_tilt_axis``);
    * ``n_views``, ``n_compared``, ``reference_index``, and ``per_view`` lists (tilt_deg,
      shift_error_px, shift_error_px_gauge_free, rotation_error_deg; 0 for the reference view).
    """
    lp, tp = _arrays(learned, "learned"), _arrays(true, "true")
    n = tp["tilt_deg"].shape[0]
    if lp["tilt_deg"].shape[0] != n:
        raise ValueError(f"pose_errors: {lp['tilt_deg'].shape[0]} learned views but {n} true views; compare poses "
                         "of the same tilt series (no excluded views in between).")
    if not np.allclose(lp["tilt_deg"], tp["tilt_deg"], rtol=0, atol=_TILT_ATOL_DEG):
        worst = float(np.max(np.abs(lp["tilt_deg"] - tp["tilt_deg"])))
        raise ValueError(f"pose_errors: the tilt angles differ (by up to {worst:.4g} degrees); compare poses of the "
                         "same views in the same order.")
    ref = int(true["reference_index"])
    if int(learned["reference_index"]) != ref or not 0 <= ref < n:
        raise ValueError(f"pose_errors: reference views differ (learned {learned['reference_index']}, true "
                         f"{true['reference_index']}) or lie outside [0, {n}); both must fix the view of smallest "
                         "|tilt|.")
    theta = np.deg2rad(tp["tilt_deg"])
    r_true = pose_rotations(theta, np.deg2rad(tp["z1_deg"]), np.deg2rad(tp["z3_deg"]))
    r_learned = pose_rotations(theta, np.deg2rad(lp["z1_deg"]), np.deg2rad(lp["z3_deg"]))
    free = np.arange(n) != ref

    d = np.stack((lp["shift_u_px"] - tp["shift_u_px"], lp["shift_v_px"] - tp["shift_v_px"]), axis=-1)  # (N, 2)
    beam = r_true[ref].T @ np.array([0.0, 0.0, 1.0])                 # reference beam direction in the volume
    a = (r_true @ beam)[:, :2]                                        # (N, 2): shift change per unit tau
    aa = float(np.sum(a[free] ** 2))
    tau = float(np.sum(a[free] * d[free]) / aa) if aa > 1e-12 else 0.0
    d_free = d - tau * a
    err_raw = np.linalg.norm(d, axis=-1)
    err_gauge = np.linalg.norm(d_free, axis=-1)

    rot_err = _geodesic_deg(r_learned, r_true)
    # the reference view's rotation counts when either side turns it (a tilt-axis error, learned
    # with pose.learn_tilt_axis); otherwise both are zero there and it is left out
    ref_turned = any(abs(a[k][ref]) > 1e-9 for a in (lp, tp) for k in ("z1_deg", "z3_deg"))
    rot_views = free | ((np.arange(n) == ref) & ref_turned)
    dz3 = (lp["z3_deg"] - tp["z3_deg"] + 180.0) % 360.0 - 180.0
    zero_ref = lambda x: np.where(free, x, 0.0)  # noqa: E731
    return {
        "n_views": n,
        "n_compared": int(free.sum()),
        "reference_index": ref,
        "shift_rms_px": _rms(err_raw[free]),
        "shift_max_px": float(err_raw[free].max(initial=0.0)),
        "shift_rms_px_gauge_free": _rms(err_gauge[free]),
        "shift_max_px_gauge_free": float(err_gauge[free].max(initial=0.0)),
        "gauge_tau_px": tau,
        "gauge_translation_xyz_px": [float(v) + 0.0 for v in -tau * beam],   # + 0.0: no "-0.0" in JSON
        "rotation_rms_deg": _rms(rot_err[rot_views]),
        "rotation_max_deg": float(rot_err[rot_views].max(initial=0.0)),
        "rotation_z3_rms_deg": _rms(dz3[rot_views]),
        "n_rotations_compared": int(rot_views.sum()),
        "per_view": {
            "tilt_deg": [float(v) for v in tp["tilt_deg"]],
            "shift_error_px": [float(v) for v in zero_ref(err_raw)],
            "shift_error_px_gauge_free": [float(v) for v in zero_ref(err_gauge)],
            "rotation_error_deg": [float(v) for v in np.where(rot_views, rot_err, 0.0)],
        },
    }


def set_poses(poses, values: Mapping[str, Any]) -> None:
    """Load per-view pose values (a pose dict, degrees and pixels) into a :class:`Poses` module,
    in place and without gradient tracking: e.g. the true poses of a synthetic series, to run the
    forward model with them. ``tilt_deg`` (if given) must match the module's angles and the
    reference view's values must be zero (the module ignores them: its pose is fixed)."""
    import torch

    n = poses.n_views
    arr = {}
    for k in ("z1_deg", "z3_deg", "shift_u_px", "shift_v_px"):
        a = np.asarray(values.get(k, np.zeros(n)), dtype=np.float64)
        if a.shape != (n,) or not np.all(np.isfinite(a)):
            raise ValueError(f"set_poses: values[{k!r}] must be {n} finite numbers, got shape {a.shape}.")
        arr[k] = a
    if "tilt_deg" in values:
        ang = poses.angles_deg()
        ang = ang if ang.ndim == 1 else ang.mean(axis=1)
        if not np.allclose(np.asarray(values["tilt_deg"], dtype=np.float64), ang, rtol=0, atol=_TILT_ATOL_DEG):
            raise ValueError("set_poses: values['tilt_deg'] do not match the module's angles; load the poses of this "
                             "tilt series, in its view order.")
    ref = poses.reference_index
    fixed = [k for k in ("z1_deg", "shift_u_px", "shift_v_px") if abs(arr[k][ref]) > 1e-9]
    if fixed:
        raise ValueError(f"set_poses: the reference view {ref} has a non-zero {', '.join(fixed)}, which Poses "
                         "ignores (it is fixed); express the poses relative to the reference view (its z3, a "
                         "rotation of every view, loads as the tilt-axis rotation).")
    axis = arr["z3_deg"][ref]   # the reference view's z3 is the rotation common to every view
    with torch.no_grad():
        p = poses.z1
        poses.z1.copy_(torch.as_tensor(np.deg2rad(arr["z1_deg"]), dtype=p.dtype, device=p.device))
        poses.z3.copy_(torch.as_tensor(np.deg2rad(arr["z3_deg"] - axis), dtype=p.dtype, device=p.device))
        poses.axis.fill_(float(np.deg2rad(axis)))
        poses.shifts.copy_(torch.as_tensor(np.stack((arr["shift_u_px"], arr["shift_v_px"]), -1), dtype=p.dtype,
                                           device=p.device))

