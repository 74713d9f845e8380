"""What every synthetic specimen shares (the ellipsoid phantoms of :mod:`fasttomo.data.phantom`
and the atomic particle of :mod:`fasttomo.data.atoms`): the error type, the seeded random
streams, rotations and the posed-projection geometry. A module of its own so that both specimen
modules import it and neither imports the other's internals."""

from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import numpy as np


class PhantomError(ValueError):
    """Raised for a phantom that cannot be built; the message names the problem and the fix."""


def euler_zxz(angles_deg: Sequence[float]) -> np.ndarray:
    """Rotation matrix R = Rz(a) @ Rx(b) @ Rz(c) of the Euler angles (a, b, c) in degrees.

    Column k of R is the world direction of the body axis k (R maps body to world coordinates).
    """
    a, b, c = np.deg2rad(np.asarray(angles_deg, dtype=np.float64).reshape(3))

    def rz(t: float) -> np.ndarray:
        return np.array([[math.cos(t), -math.sin(t), 0.0], [math.sin(t), math.cos(t), 0.0], [0.0, 0.0, 1.0]])

    def rx(t: float) -> np.ndarray:
        return np.array([[1.0, 0.0, 0.0], [0.0, math.cos(t), -math.sin(t)], [0.0, math.sin(t), math.cos(t)]])

    return rz(a) @ rx(b) @ rz(c)


POSE_KEYS = ("z1_deg", "z3_deg", "shift_u_px", "shift_v_px")
"""The per-view pose keys :func:`project` reads (those of ``Poses.describe()``)."""


def _pose_arrays(poses: Mapping[str, Any], tilt_deg: np.ndarray) -> tuple[np.ndarray, ...]:
    """(z1, z3) in radians and (su, sv) in pixels, each (N,) float64, from a poses mapping."""
    if not isinstance(poses, Mapping):
        raise PhantomError(f"project: poses must be a mapping with keys {list(POSE_KEYS)} (per-view lists), "
                           f"got a {type(poses).__name__}.")
    n = tilt_deg.shape[0]
    if not any(k in poses for k in POSE_KEYS):
        raise PhantomError(f"project: poses has none of the keys {list(POSE_KEYS)}; give per-view lists "
                           "(the format of Poses.describe() or metadata['true_poses']), or poses=None.")
    out = []
    for key in POSE_KEYS:
        a = np.asarray(poses.get(key, np.zeros(n)), dtype=np.float64)
        if a.shape != (n,) or not np.all(np.isfinite(a)):
            raise PhantomError(f"project: poses[{key!r}] must be {n} finite numbers (one per view), got shape "
                               f"{a.shape}.")
        out.append(a)
    if "tilt_deg" in poses:
        t = np.asarray(poses["tilt_deg"], dtype=np.float64)
        if t.shape != (n,) or not np.allclose(t, tilt_deg, rtol=0, atol=1e-3):
            raise PhantomError("project: poses['tilt_deg'] does not match the angles given (same views in the "
                               "same order expected); pass the poses of this tilt series.")
    z1, z3, su, sv = out
    return np.deg2rad(z1), np.deg2rad(z3), su, sv


def pose_rotations(theta_rad: np.ndarray, z1_rad: np.ndarray, z3_rad: np.ndarray) -> np.ndarray:
    """R = Rz(z3) Ry(theta) Rz(z1) as float64 (..., 3, 3): numpy twin of the pose model of
    :mod:`fasttomo.geometry.poses` (``rot_y``/``rot_z`` of :mod:`fasttomo.geometry.so3`).
    The arguments broadcast against each other."""
    theta_rad, z1_rad, z3_rad = np.broadcast_arrays(*(np.asarray(a, dtype=np.float64)
                                                      for a in (theta_rad, z1_rad, z3_rad)))

    def rz(a: np.ndarray) -> np.ndarray:
        c, s, o, z = np.cos(a), np.sin(a), np.ones_like(a), np.zeros_like(a)
        return np.stack((c, -s, z, s, c, z, z, z, o), axis=-1).reshape(a.shape + (3, 3))

    c, s, o, z = np.cos(theta_rad), np.sin(theta_rad), np.ones_like(theta_rad), np.zeros_like(theta_rad)
    ry = np.stack((c, z, s, z, o, z, -s, z, c), axis=-1).reshape(theta_rad.shape + (3, 3))
    return rz(z3_rad) @ ry @ rz(z1_rad)


def _stream(seed: int, *key: int) -> np.random.Generator:
    """The independent random stream ``key`` of ``seed`` (see the module docstring)."""
    if not (isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) and seed >= 0):
        raise PhantomError(f"seed must be an integer >= 0, got {seed!r}.")
    return np.random.default_rng(np.random.SeedSequence(int(seed), spawn_key=key))
