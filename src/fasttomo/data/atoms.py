"""An atomic phantom: a nanoparticle of Gaussian atoms (``data.phantom=nanoparticle``).

A sphere cut from an FCC lattice (lattice constant ``data.particle.lattice`` Angstrom, radius
``data.particle.radius``), each atom an isotropic 3-D Gaussian of width ``data.particle.sigma``
Angstrom and peak density 1 (species 1) or ``data.particle.contrast`` (species 2, a random
``data.particle.fraction`` of the atoms when ``data.particle.species=2``, drawn from
``SeedSequence(phantom_seed, spawn_key=(3,))``). The lattice is turned by the z-x-z Euler angles
``data.particle.orientation`` (degrees), so no atom column need lie along a tilt direction.

Geometry and units are those of :mod:`fasttomo.data.phantom`: centred voxel units (voxel = pixel
size), (u, v) = first two rows of R p + (su, sv) for a view with pose R (the ideal view:
u = x cos(theta) + z sin(theta), v = y). A Gaussian of peak density A and width s (voxels)
projects along any direction to the 2-D Gaussian A sqrt(2 pi) s exp(-d^2 / 2 s^2) (d the
distance from the atom's projected centre in the detector plane), so the projections are exact
line integrals sampled at the pixel centres, like the ground truth volume is the density sampled
at the voxel centres.

The true coordinates (:meth:`AtomPhantom.table`) are given in the frame of fasttomo-trace's
atoms.csv: Angstrom, origin at the centre of the volume's first voxel, x along X (columns), y along
Y (rows), z along Z (sections).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fasttomo.data.specimen import PhantomError, _pose_arrays, _stream, euler_zxz, pose_rotations

_ATOM_STREAM = 3
DEFAULT_ATOM_PIXEL_SIZE = 0.75
"""Pixel size (Angstrom) of the nanoparticle phantom when data.pixel_size is not set: FCC gold's
nearest neighbours (2.88 A) are then 3.8 voxels apart."""


def fcc_sphere(radius: float, lattice: float, rotation: np.ndarray | None = None) -> np.ndarray:
    """(N, 3) positions (same unit as the arguments) of the FCC lattice sites within ``radius`` of
    the origin (a site at the origin), turned by ``rotation`` (3x3)."""
    n = int(math.ceil(radius / lattice)) + 1
    r = np.arange(-n, n + 1, dtype=np.float64)
    cells = np.stack(np.meshgrid(r, r, r, indexing="ij"), -1).reshape(-1, 3)
    basis = np.array([[0, 0, 0], [0.5, 0.5, 0], [0.5, 0, 0.5], [0, 0.5, 0.5]])
    pts = (cells[:, None, :] + basis[None]).reshape(-1, 3) * lattice
    pts = pts[np.linalg.norm(pts, axis=1) <= radius + 1e-9]
    if rotation is not None:
        pts = pts @ np.asarray(rotation).T
    order = np.lexsort((pts[:, 0], pts[:, 1], pts[:, 2]))
    return pts[order]


@dataclasses.dataclass
class AtomPhantom:
    """Gaussian atoms in a box of (Z, Y, X) voxels; positions centred voxel units (x, y, z)."""

    shape_zyx: tuple
    xyz: np.ndarray
    """(N, 3) centred (x, y, z) voxel coordinates (voxel (k, i, j) is at j - (X-1)/2, ...)."""
    species: np.ndarray
    """(N,) 1 or 2."""
    amplitude: np.ndarray
    """(N,) peak density per voxel length."""
    sigma: float
    """Gaussian width in voxels."""
    name: str = "nanoparticle"

    def __post_init__(self) -> None:
        half = np.array(self.shape_zyx[::-1], dtype=np.float64) / 2.0
        reach = np.abs(self.xyz).max(axis=0) + 4.0 * self.sigma if len(self.xyz) else np.zeros(3)
        if np.any(reach > half):
            raise PhantomError(
                f"the nanoparticle reaches |x, y, z| = {np.round(reach, 2).tolist()} voxels (atom centres plus 4 sigma) "
                f"but the box (Z, Y, X) = {tuple(self.shape_zyx)} allows {half.tolist()}; make data.particle.radius "
                "smaller, data.pixel_size larger, or the box bigger (data.width, data.height, data.thickness).")

    @property
    def zyx_index(self) -> np.ndarray:
        """(N, 3) positions in voxel index coordinates (z, y, x) of the volume."""
        centre = (np.array(self.shape_zyx, dtype=np.float64) - 1.0) / 2.0
        return self.xyz[:, ::-1] + centre

    def table(self, pixel_size: float) -> dict:
        """True atoms in atoms.csv's frame: xyz_A (N, 3), intensity (integrated, volume units x
        voxels), species."""
        zyx = self.zyx_index
        return {"xyz_A": zyx[:, ::-1] * pixel_size,
                "intensity": self.amplitude * (2 * math.pi) ** 1.5 * self.sigma ** 3,
                "species": self.species.astype(np.int64)}

    def describe(self) -> dict:
        return {"name": self.name, "shape_zyx": list(self.shape_zyx), "n_atoms": int(len(self.xyz)),
                "n_species_2": int((self.species == 2).sum()), "sigma_voxels": float(self.sigma),
                "amplitudes": sorted(set(float(a) for a in self.amplitude))}

    def volume(self) -> np.ndarray:
        """Ground truth (Z, Y, X) float32: the density at the voxel centres."""
        import torch

        from fasttomo.data.gauss import render

        vol = render(self.shape_zyx, torch.from_numpy(self.zyx_index), torch.from_numpy(self.amplitude),
                     float(self.sigma), radius=max(1, int(math.ceil(5.0 * self.sigma))))
        return vol.numpy().astype(np.float32)

    def project(self, angles_deg: np.ndarray, height: int, width: int, poses=None) -> np.ndarray:
        """Exact line integrals at the pixel centres, (N, H, W) float32 (see the module doc)."""
        ang = np.asarray(angles_deg, dtype=np.float64)
        if ang.ndim != 1:
            raise PhantomError("the nanoparticle phantom takes one tilt angle per view (angles of shape (n,)).")
        n = ang.shape[0]
        if poses is not None:
            z1, z3, su, sv = _pose_arrays(poses, ang)
        else:
            z1 = z3 = su = sv = np.zeros(n)
        rot = pose_rotations(np.deg2rad(ang), z1, z3)                          # (N, 3, 3)
        uv = np.einsum("nij,aj->nai", rot[:, :2, :], self.xyz) + np.stack([su, sv], -1)[:, None, :]
        s = float(self.sigma)
        r = int(math.ceil(5.0 * s)) + 1
        out = np.zeros((n, height, width), dtype=np.float64)
        off = np.arange(-r, r + 1)
        for k in range(n):
            cj = np.round(uv[k, :, 0] + (width - 1) / 2.0).astype(np.int64)   # nearest pixel column
            ci = np.round(uv[k, :, 1] + (height - 1) / 2.0).astype(np.int64)
            jj = cj[:, None] + off[None]                                       # (A, 2r+1)
            ii = ci[:, None] + off[None]
            du = jj - (width - 1) / 2.0 - uv[k, :, 0:1]
            dv = ii - (height - 1) / 2.0 - uv[k, :, 1:2]
            gu = np.exp(-0.5 * (du / s) ** 2)
            gv = np.exp(-0.5 * (dv / s) ** 2)
            val = (self.amplitude * math.sqrt(2 * math.pi) * s)[:, None, None] * gv[:, :, None] * gu[:, None, :]
            ok = (ii[:, :, None] >= 0) & (ii[:, :, None] < height) & (jj[:, None, :] >= 0) & (jj[:, None, :] < width)
            flat = ii[:, :, None] * width + jj[:, None, :]
            np.add.at(out[k].reshape(-1), flat[ok], val[ok])
        return out.astype(np.float32)


def nanoparticle(shape_zyx, pixel_size: float, cfg, seed: int) -> AtomPhantom:
    """The phantom of ``data.particle`` (a :class:`fasttomo.config.ParticleConfig`) in a box of
    ``shape_zyx`` voxels of ``pixel_size`` Angstrom."""
    rot = euler_zxz(cfg.orientation)
    xyz = fcc_sphere(cfg.radius / pixel_size, cfg.lattice / pixel_size, rot)
    if len(xyz) == 0:
        raise PhantomError(f"data.particle.radius={cfg.radius} A holds no atom; make it at least a few Angstrom.")
    species = np.ones(len(xyz), dtype=np.int64)
    if cfg.species == 2:
        rng = _stream(seed, _ATOM_STREAM)
        species[rng.uniform(size=len(xyz)) < cfg.fraction] = 2
    amplitude = np.where(species == 2, float(cfg.contrast), 1.0)
    return AtomPhantom(tuple(int(s) for s in shape_zyx), xyz, species, amplitude, cfg.sigma / pixel_size,
                       name=f"FCC nanoparticle (radius {cfg.radius:g} A, lattice {cfg.lattice:g} A, "
                            f"{len(xyz)} atoms)")
