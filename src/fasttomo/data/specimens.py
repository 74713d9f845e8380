"""Specimens that look like real ones: a cell section (``data.phantom=cell``) and a supported
catalyst (``data.phantom=catalyst``).

Every part is a primitive whose line integral is known in closed form, so the projections are
exact line integrals at the pixel centres, as for the ellipsoid phantoms (geometry and units of
:mod:`fasttomo.data.phantom`: centred voxel units, voxel = pixel, (u, v) = first two rows of
R p + (su, sv) for a view with pose R):

* solid ellipsoids (:class:`fasttomo.data.ellipsoids.Phantom`; a shell is an ellipsoid minus a
  smaller one, a hole a negative density): exact chord lengths;
* isotropic Gaussian blobs (the crowded texture): a 3-D Gaussian of peak A and width s projects
  along any direction to A sqrt(2 pi) s exp(-d^2 / 2 s^2) (a row factor times a column factor,
  summed over blobs by one matrix product per view);
* convex polyhedra (the crystalline particles): the chord through the intersection of the
  half-spaces n.p <= h, exact.

The ground truth (:meth:`Specimen.volume`) is the ellipsoids and polyhedra averaged over 2^3
points per voxel (partial volume, as :func:`fasttomo.data.ellipsoids.voxelize`) plus the Gaussians
sampled at the voxel centres (each blob is at least one voxel wide, so sampling it is faithful).

Sizes are physical, in Angstrom; the pixel size (``data.pixel_size``) turns them into voxels,
and the number of objects follows the box's physical volume (or, for the catalyst's particles,
the support's surface). An object that cannot fit in the box is left out; a box too small for the
specimen's main body is an error that names the fix.

Seeds: part k of a specimen draws from its own stream, ``SeedSequence(phantom_seed,
spawn_key=(5, k))`` for the cell (k = 0 vesicles, 1 filaments, 2 ribosomes, 3 texture, 4 gold)
and ``(6, k)`` for the catalyst (0 support, 1 pores, 2 particles, 3 texture). Objects are placed
in turn (cell: gold, ribosomes, vesicles, filaments; catalyst: pores, particles), each apart from
those placed before it, so a part's draws never change with another's, though where a later part
fits does.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import numpy as np

from fasttomo.data.ellipsoids import Ellipsoid, Phantom, _uniform_rotation, project, voxelize
from fasttomo.data.specimen import PhantomError, _pose_arrays, _stream, pose_rotations

CELL_PIXEL_SIZE = 10.0
"""Pixel size (Angstrom) of the cell specimen when data.pixel_size is not set."""
CATALYST_PIXEL_SIZE = 2.5
"""Pixel size (Angstrom) of the catalyst specimen when data.pixel_size is not set."""
SUPERSAMPLE = 2
"""Points per voxel and axis of the partial-volume ground truth of the solid parts."""
_CELL_STREAM, _CATALYST_STREAM = 5, 6

# ------------------------------------------------------------------------------------ sizes (Angstrom)
CELL = dict(
    cytoplasm_density=0.15,
    texture_sigma=(15.0, 30.0), texture_amplitude=(0.04, 0.12), texture_per_A3=1.0 / 60.0 ** 3,
    vesicle_radius=(150.0, 300.0), vesicle_fraction=0.25, leaflet_thickness=15.0, leaflet_spacing=40.0,
    leaflet_density=0.6, lumen_density=-0.05,
    filament_per_A3=1.0 / 450.0 ** 3, filament_length=(600.0, 1500.0), actin_bead_radius=22.0,
    actin_rise=27.5, actin_twist_deg=-166.7, actin_radius=10.0, actin_density=0.5,
    ribosome_per_A3=1.0 / 600.0 ** 3, ribosome_large=100.0, ribosome_small=(80.0, 50.0, 50.0),
    ribosome_density=0.45, rna_radius=(25.0, 40.0), rna_count=(3, 6), rna_density=0.35,
    gold_radius=50.0, gold_density=5.0, gold_per_A2=1.0 / 1000.0 ** 2,
)
"""The cell section's parts (Angstrom, densities per voxel length; see docs/specimens.md)."""
CATALYST = dict(
    support_density=0.2, pore_radius=(15.0, 50.0), pore_fraction=0.35,
    texture_sigma=(8.0, 15.0), texture_amplitude=(0.02, 0.06), texture_per_A3=1.0 / 30.0 ** 3,
    particle_size=(10.0, 100.0), particle_per_A2=1.0 / 60.0 ** 2, particle_density=2.0, h100_over_h111=1.15,
)
"""The catalyst's parts (Angstrom, densities per voxel length; see docs/specimens.md)."""


# ------------------------------------------------------------------------------------ Gaussian blobs
@dataclasses.dataclass
class Blobs:
    """Isotropic 3-D Gaussians: peak ``amplitude`` (N,), width ``sigma`` (N,) voxels, centres
    ``xyz`` (N, 3) in centred voxel units."""

    xyz: np.ndarray
    sigma: np.ndarray
    amplitude: np.ndarray

    def project_view(self, rot: np.ndarray, shift: np.ndarray, height: int, width: int) -> np.ndarray:
        """(H, W) exact line integrals of one view with rotation ``rot`` (3, 3) and shift (2,):
        sum over blobs of (A sqrt(2 pi) s) g_v(row) g_u(column), Gaussian factors g."""
        uv = self.xyz @ rot[:2].T + shift                                       # (N, 2)
        weight = self.amplitude * math.sqrt(2.0 * math.pi) * self.sigma
        return _separable(_Factors(uv[:, 1] + (height - 1) / 2.0, self.sigma, weight),
                          [uv[:, 0] + (width - 1) / 2.0], (height, width))

    def render(self, shape_zyx) -> np.ndarray:
        """(Z, Y, X) float64: the Gaussians sampled at the voxel centres."""
        z, y, x = (int(s) for s in shape_zyx)
        return _separable(_Factors(self.xyz[:, 2] + (z - 1) / 2.0, self.sigma, self.amplitude),
                          [self.xyz[:, 1] + (y - 1) / 2.0, self.xyz[:, 0] + (x - 1) / 2.0], (z, y, x))


@dataclasses.dataclass
class _Factors:
    """Gaussians along the first axis: centres (N,) in index units, widths (N,), weights (N,)."""

    centre: np.ndarray
    sigma: np.ndarray
    weight: np.ndarray


def _separable(first: _Factors, others: list, shape: tuple) -> np.ndarray:
    """sum_n weight_n g(i0 - c0_n) g(i1 - c1_n) [g(i2 - c2_n)] on the grid ``shape`` (2-D or 3-D),
    g(d) = exp(-d^2 / 2 sigma_n^2), with ``others`` the centres along the remaining axes. Matrix
    products in float64 (torch); in 3-D one section of the first axis at a time, with only the
    Gaussians within 6 sigma of it (their factor elsewhere is below exp(-18))."""
    import torch

    out = torch.zeros(shape, dtype=torch.float64)
    if len(first.centre) == 0:
        return out.numpy()
    sig = torch.from_numpy(np.asarray(first.sigma, dtype=np.float64))[:, None]

    def g(centre: np.ndarray, n: int) -> torch.Tensor:                         # (N, n)
        c = torch.from_numpy(np.asarray(centre, dtype=np.float64))[:, None]
        d = torch.arange(n, dtype=torch.float64)[None, :] - c
        return torch.exp(-0.5 * (d / sig) ** 2)

    g0 = g(first.centre, shape[0]) * torch.from_numpy(np.asarray(first.weight, dtype=np.float64))[:, None]
    g1 = g(others[0], shape[1])
    if len(shape) == 2:
        return (g0.T @ g1).numpy()
    g2 = g(others[1], shape[2])
    near = np.abs(np.arange(shape[0])[None, :] - first.centre[:, None]) <= 6.0 * first.sigma[:, None]
    for i in range(shape[0]):
        sel = torch.from_numpy(np.flatnonzero(near[:, i]))
        if sel.numel():
            out[i] = (g1[sel] * g0[sel, i:i + 1]).T @ g2[sel]
    return out.numpy()


# ------------------------------------------------------------------------------------ convex polyhedra
@dataclasses.dataclass
class Polyhedra:
    """Convex polyhedra of constant density: particle k is {p : normals[k] . (p - centres[k]) <=
    offsets[k]} (unit normals (K, F, 3), offsets (K, F) voxels), inside a ball of ``radius`` (K,)."""

    centres: np.ndarray
    normals: np.ndarray
    offsets: np.ndarray
    radius: np.ndarray
    density: np.ndarray

    def project_view(self, rot: np.ndarray, shift: np.ndarray, height: int, width: int) -> np.ndarray:
        """(H, W) exact chord lengths times density of one view (``rot`` (3, 3), ``shift`` (2,)).

        The ray of pixel (u, v) is p(t) = R^T ((u - su, v - sv, 0) + t e_z). With m = R n and
        (du, dv) the pixel's offset from the particle's projected centre, the ray lies on the inner
        side of the face (n, h) where m_x du + m_y dv + m_z t' <= h (t' the depth from the
        centre's): a half-line per face, and the chord is the length of their intersection."""
        out = np.zeros((height, width))
        for k in range(len(self.centres)):
            rc = rot @ self.centres[k]
            cu, cv = rc[0] + shift[0] + (width - 1) / 2.0, rc[1] + shift[1] + (height - 1) / 2.0
            r = self.radius[k]
            j0, j1 = max(0, int(math.floor(cu - r))), min(width, int(math.ceil(cu + r)) + 1)
            i0, i1 = max(0, int(math.floor(cv - r))), min(height, int(math.ceil(cv + r)) + 1)
            if j0 >= j1 or i0 >= i1:
                continue
            du = (np.arange(j0, j1) - cu)[None, :, None]                        # relative to the centre
            dv = (np.arange(i0, i1) - cv)[:, None, None]
            m = self.normals[k] @ rot.T                                          # (F, 3): R n
            rhs = self.offsets[k] - m[:, 0] * du - m[:, 1] * dv                  # (h, w, F)
            q = m[:, 2]
            with np.errstate(divide="ignore", invalid="ignore"):
                t = rhs / q
            hi = np.where(q > 0, t, np.inf).min(-1)
            lo = np.where(q < 0, t, -np.inf).max(-1)
            blocked = ((q == 0) & (rhs < 0)).any(-1)
            chord = np.where(blocked, 0.0, np.maximum(hi - lo, 0.0))
            out[i0:i1, j0:j1] += self.density[k] * chord
        return out

    def voxelize(self, shape_zyx, supersample: int = SUPERSAMPLE) -> np.ndarray:
        """(Z, Y, X) float64: the density averaged over supersample^3 points per voxel."""
        vol = np.zeros(shape_zyx)
        ss = int(supersample)
        for k in range(len(self.centres)):
            box = []
            for ax in range(3):                                                  # z, y, x
                n, c = shape_zyx[ax], self.centres[k][2 - ax] + (shape_zyx[ax] - 1) / 2.0
                r = self.radius[k]
                box.append((max(0, int(math.floor(c - r))), min(n, int(math.ceil(c + r)) + 1)))
            if any(a >= b for a, b in box):
                continue
            axes = [(np.arange(a * ss, b * ss) + 0.5) / ss - 0.5 - (shape_zyx[ax] - 1) / 2.0 - self.centres[k][2 - ax]
                    for ax, (a, b) in enumerate(box)]
            z, y, x = np.meshgrid(*axes, indexing="ij")
            inside = np.ones(z.shape, dtype=bool)
            for n_, h in zip(self.normals[k], self.offsets[k]):
                inside &= n_[0] * x + n_[1] * y + n_[2] * z <= h
            (za, zb), (ya, yb), (xa, xb) = box
            frac = inside.reshape(zb - za, ss, yb - ya, ss, xb - xa, ss).mean(axis=(1, 3, 5))
            vol[za:zb, ya:yb, xa:xb] += self.density[k] * frac
        return vol


def truncated_octahedron(h111: float, h100: float, rotation: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Face normals (14, 3) and offsets (14,) of the FCC Wulff shape: the 8 {111} faces at
    ``h111`` and the 6 {100} faces at ``h100`` from the centre, turned by ``rotation``."""
    n111 = np.array([[a, b, c] for a in (-1, 1) for b in (-1, 1) for c in (-1, 1)], dtype=np.float64) / math.sqrt(3.0)
    n100 = np.concatenate([np.eye(3), -np.eye(3)])
    normals = np.concatenate([n111, n100]) @ np.asarray(rotation).T
    return normals, np.concatenate([np.full(8, h111), np.full(6, h100)])


# ------------------------------------------------------------------------------------ the specimen
@dataclasses.dataclass
class Specimen:
    """A composite specimen in a box of (Z, Y, X) voxels: ellipsoids (a Phantom), Gaussian blobs
    and convex polyhedra, whose densities add. ``parts`` counts the objects of each kind."""

    shape_zyx: tuple
    phantom: Any
    blobs: Blobs
    polyhedra: Polyhedra | None
    name: str
    parts: dict

    def project(self, angles_deg: np.ndarray, height: int, width: int,
                poses: Mapping[str, Any] | None = None) -> np.ndarray:
        """Exact line integrals at the pixel centres, (N, H, W) float32 (see the module doc)."""
        ang = np.asarray(angles_deg, dtype=np.float64)
        if ang.ndim != 1:
            raise PhantomError(f"the {self.name} specimen takes one tilt angle per view (angles of shape (n,)).")
        out = project(self.phantom, ang, height, width, poses=poses).astype(np.float64)
        n = ang.shape[0]
        if poses is not None:
            z1, z3, su, sv = _pose_arrays(poses, ang)
        else:
            z1 = z3 = su = sv = np.zeros(n)
        rot = pose_rotations(np.deg2rad(ang), z1, z3)
        shifts = np.stack([su, sv], -1)
        for k in range(n):
            if len(self.blobs.xyz):
                out[k] += self.blobs.project_view(rot[k], shifts[k], height, width)
            if self.polyhedra is not None:
                out[k] += self.polyhedra.project_view(rot[k], shifts[k], height, width)
        return out.astype(np.float32)

    def volume(self) -> np.ndarray:
        """Ground truth (Z, Y, X) float32 (see the module doc)."""
        vol = voxelize(self.phantom, self.shape_zyx, SUPERSAMPLE).astype(np.float64)
        vol += self.blobs.render(self.shape_zyx)
        if self.polyhedra is not None:
            vol += self.polyhedra.voxelize(self.shape_zyx)
        return vol.astype(np.float32)

    def describe(self) -> dict:
        return {"name": self.name, "shape_zyx": list(self.shape_zyx), "parts": dict(self.parts)}


# ------------------------------------------------------------------------------------ placement
@dataclasses.dataclass
class _Room:
    """Where objects go: inside the body ellipsoid of semi-axes ``body`` (x, y, z voxels) at the
    origin, apart from the balls already ``placed`` ((centre, radius) voxels)."""

    body: np.ndarray
    half: np.ndarray
    """Half sizes (x, y, z) of the box, voxels."""
    placed: list = dataclasses.field(default_factory=list)

    def free(self, centre: np.ndarray, radius: float) -> bool:
        return all(np.linalg.norm(centre - c) >= radius + r for c, r in self.placed)

    def inside(self, centre: np.ndarray, radius: float) -> bool:
        room = self.body - radius
        return bool(np.all(room > 0) and np.sum((centre / room) ** 2) <= 1.0)

    def place(self, rng: np.random.Generator, radius: float, tries: int = 60) -> np.ndarray | None:
        """A centre for a ball of ``radius`` inside the body and apart from the others, or None."""
        room = self.body - radius
        if np.any(room <= 0):
            return None
        for _ in range(tries):
            c = rng.uniform(-1.0, 1.0, size=3) * room
            if self.inside(c, radius) and self.free(c, radius):
                self.placed.append((c, float(radius)))
                return c
        return None


def _unit(rng: np.random.Generator) -> np.ndarray:
    d = rng.normal(size=3)
    return d / np.linalg.norm(d)


def _count(per_unit: float, amount: float, rng: np.random.Generator) -> int:
    """A Poisson count of mean ``per_unit * amount``."""
    return int(rng.poisson(per_unit * amount))


def _ellipsoid_volume_A3(axes_vox: np.ndarray, pixel_size: float) -> float:
    return 4.0 / 3.0 * math.pi * float(np.prod(axes_vox)) * pixel_size ** 3


def _texture(rng: np.random.Generator, room: _Room, spec: dict, pixel_size: float, holes=()) -> Blobs:
    """Gaussian blobs centred uniformly over the body (not in ``holes``, a list of (centre, radius),
    and 4 widths inside the box, so their mass stays in it): a Poisson number of mean
    texture_per_A3 x body volume; widths at least one voxel."""
    n = _count(spec["texture_per_A3"], _ellipsoid_volume_A3(room.body, pixel_size), rng)
    sig = np.maximum(rng.uniform(*spec["texture_sigma"], size=n) / pixel_size, 1.0)
    amp = rng.uniform(*spec["texture_amplitude"], size=n)
    xyz = rng.uniform(-1.0, 1.0, size=(n, 3)) * room.body
    keep = np.array([room.inside(p, 0.0) for p in xyz], dtype=bool).reshape(n)
    keep &= np.all(np.abs(xyz) + 4.0 * sig[:, None] <= room.half, axis=1)
    for c, r in holes:
        keep &= np.linalg.norm(xyz - c, axis=1) > r
    return Blobs(xyz[keep], sig[keep], amp[keep])


# ------------------------------------------------------------------------------------ cell
def _vesicles(rng: np.random.Generator, room: _Room, pixel_size: float) -> tuple[list, list]:
    """Spherical vesicles with a lipid bilayer: two leaflets (shells leaflet_thickness thick whose
    centres lie leaflet_spacing apart) around a lighter lumen, until they fill vesicle_fraction of
    the body (or no more fit); radii uniform in vesicle_radius, capped by the body's thinnest half
    size. Returns (ellipsoids, radii in A)."""
    c = CELL
    t, s, rho = c["leaflet_thickness"] / pixel_size, c["leaflet_spacing"] / pixel_size, c["leaflet_density"]
    target = c["vesicle_fraction"] * _ellipsoid_volume_A3(room.body, pixel_size)
    filled, misses, out, radii = 0.0, 0, [], []
    while filled < target and misses < 50:
        lo, hi = c["vesicle_radius"]
        r_a = float(rng.uniform(lo, max(lo, min(hi, (float(room.body.min()) - 2.0) * pixel_size))))
        r = r_a / pixel_size
        centre = room.place(rng, r + 1.0)
        if centre is None:
            misses += 1
            continue
        k = len(radii)
        for radius, dens, what in ((r, rho, "outer leaflet"), (r - t, -rho, "outer leaflet (inside)"),
                                   (r - s, rho, "inner leaflet"), (r - s - t, -rho + c["lumen_density"], "lumen")):
            out.append(Ellipsoid(centre, (radius,) * 3, None, dens, f"vesicle {k} {what}"))
        radii.append(r_a)
        filled += 4.0 / 3.0 * math.pi * r_a ** 3
    return out, radii


def _filaments(rng: np.random.Generator, room: _Room, pixel_size: float) -> tuple[list, int]:
    """Actin-like filaments: straight runs of filament_length whose subunits (spheres of
    actin_bead_radius) follow the genetic helix of F-actin (rise actin_rise, twist actin_twist_deg,
    actin_radius off the axis); subunits outside the body or inside another object are left out.
    Returns (ellipsoids, number of filaments)."""
    c = CELL
    n = _count(c["filament_per_A3"], _ellipsoid_volume_A3(room.body, pixel_size), rng)
    bead = c["actin_bead_radius"] / pixel_size
    out, others = [], list(room.placed)
    for f in range(n):
        length = float(rng.uniform(*c["filament_length"]))
        d = _unit(rng) * np.array([1.0, 1.0, 0.3])                            # mostly along the section
        d /= np.linalg.norm(d)
        e1 = np.cross(d, [1.0, 0.0, 0.0] if abs(d[0]) < 0.9 else [0.0, 1.0, 0.0])
        e1 /= np.linalg.norm(e1)
        e2 = np.cross(d, e1)
        mid = rng.uniform(-1.0, 1.0, size=3) * room.body
        while not room.inside(mid, 0.0):
            mid = rng.uniform(-1.0, 1.0, size=3) * room.body
        n_sub = int(length / c["actin_rise"])
        start = mid - 0.5 * n_sub * c["actin_rise"] * d / pixel_size
        for i in range(n_sub):
            phi = math.radians(c["actin_twist_deg"]) * i
            off = i * c["actin_rise"] * d + c["actin_radius"] * (math.cos(phi) * e1 + math.sin(phi) * e2)
            p = start + off / pixel_size
            if room.inside(p, bead + 1.0) and all(np.linalg.norm(p - q) >= bead + r for q, r in others):
                out.append(Ellipsoid(p, (bead,) * 3, None, c["actin_density"], f"filament {f} subunit {i}"))
    return out, n


def _ribosomes(rng: np.random.Generator, room: _Room, pixel_size: float) -> tuple[list, int]:
    """Ribosome-sized particles (~250 A): a large subunit (sphere of ribosome_large radius) with
    rna_count dense RNA-like cores inside it, and a small subunit (ellipsoid ribosome_small)
    against it. Returns (ellipsoids, number placed)."""
    c = CELL
    n = _count(c["ribosome_per_A3"], _ellipsoid_volume_A3(room.body, pixel_size), rng)
    big, small = c["ribosome_large"] / pixel_size, np.array(c["ribosome_small"]) / pixel_size
    out, placed = [], 0
    for k in range(n):
        centre = room.place(rng, big + 0.3 * small[1] + small[0] + 1.0)
        if centre is None:
            continue
        placed += 1
        out.append(Ellipsoid(centre, (big,) * 3, None, c["ribosome_density"], f"ribosome {k} large subunit"))
        rot = _uniform_rotation(rng)
        out.append(Ellipsoid(centre + (big + 0.6 * small[1]) * rot[:, 1], small, rot, c["ribosome_density"],
                             f"ribosome {k} small subunit"))
        for j in range(int(rng.integers(c["rna_count"][0], c["rna_count"][1] + 1))):
            r = float(rng.uniform(*c["rna_radius"])) / pixel_size
            off = _unit(rng) * rng.uniform(0.0, big - r)
            out.append(Ellipsoid(centre + off, (r,) * 3, None, c["rna_density"], f"ribosome {k} RNA core {j}"))
    return out, placed


def _gold(rng: np.random.Generator, room: _Room, shape_zyx, pixel_size: float) -> tuple[list, int]:
    """Gold fiducials (spheres of gold_radius, gold_density) on the two faces of the section: a
    Poisson number of mean gold_per_A2 x the section's area, at least one when it fits."""
    c = CELL
    half = np.array(shape_zyx[::-1], dtype=np.float64) / 2.0
    r = c["gold_radius"] / pixel_size
    n = max(1, _count(c["gold_per_A2"], 4.0 * half[0] * half[1] * pixel_size ** 2, rng))
    out = []
    if np.any(half - r - 1.0 <= 0):
        return out, 0
    for k in range(n):
        for _ in range(60):
            face = rng.choice([-1.0, 1.0]) * (half[2] - r - 1.0)
            p = np.append(rng.uniform(-1.0, 1.0, size=2) * (half[:2] - r - 1.0), face)
            if room.free(p, r):
                room.placed.append((p, r))
                out.append(Ellipsoid(p, (r,) * 3, None, c["gold_density"], f"gold fiducial {k}"))
                break
    return out, len(out)


def cell_thickness(width: int, pixel_size: float) -> int:
    """Default thickness (voxels) of the cell section: about W/2 (an even number), but at least
    what holds the smallest vesicle."""
    need = 2 * int(math.ceil(CELL["vesicle_radius"][0] / pixel_size + 3.0))
    return max(2 * int(round(width / 4.0)), need)


def cell(shape_zyx, pixel_size: float, seed: int) -> Specimen:
    """A vesicle-rich cytoplasm section in a box of ``shape_zyx`` voxels of ``pixel_size`` A
    (sizes and densities: :data:`CELL`; see docs/specimens.md)."""
    shape = tuple(int(s) for s in shape_zyx)
    half = np.array(shape[::-1], dtype=np.float64) / 2.0
    body = half - 1.0
    need = CELL["vesicle_radius"][0] + 2.0 * pixel_size          # half size that holds the smallest vesicle
    if float(body.min()) * pixel_size < need:
        raise PhantomError(
            f"data.phantom=cell: the box (Z, Y, X) = {shape} voxels of {pixel_size:g} A is {2 * half.min() * pixel_size:.0f} A "
            f"across at its thinnest; the cell needs at least {2 * need + 2 * pixel_size:.0f} A to hold a vesicle. "
            "Raise data.pixel_size or the box (data.width, data.height, data.thickness).")
    room = _Room(body, half)
    gold, n_gold = _gold(_stream(seed, _CELL_STREAM, 4), room, shape, pixel_size)
    ribo, n_ribo = _ribosomes(_stream(seed, _CELL_STREAM, 2), room, pixel_size)
    ves, radii = _vesicles(_stream(seed, _CELL_STREAM, 0), room, pixel_size)
    fil, n_fil = _filaments(_stream(seed, _CELL_STREAM, 1), room, pixel_size)
    blobs = _texture(_stream(seed, _CELL_STREAM, 3), room, CELL, pixel_size)
    cyto = Ellipsoid((0.0, 0.0, 0.0), body, None, CELL["cytoplasm_density"], "cytoplasm")
    phantom = Phantom(shape, [cyto, *ves, *fil, *ribo, *gold], margin=0.5, name="cell section")
    parts = {"pixel_size_A": float(pixel_size), "vesicles": len(radii), "vesicle_radii_A": [round(r, 1) for r in radii],
             "filaments": n_fil, "actin_subunits": len(fil), "ribosomes": n_ribo, "gold_fiducials": n_gold,
             "gold_radius_A": CELL["gold_radius"], "texture_blobs": int(len(blobs.xyz))}
    return Specimen(shape, phantom, blobs, None, f"cell section (seed {int(seed)})", parts)


# ------------------------------------------------------------------------------------ catalyst
def _pores(rng: np.random.Generator, room: _Room, pixel_size: float) -> list:
    """Spherical pores (holes: density -support_density) inside the support, apart from each
    other, until they take pore_fraction of it (or no more fit). Returns (centre, radius) voxels."""
    c = CATALYST
    target = c["pore_fraction"] * _ellipsoid_volume_A3(room.body, pixel_size)
    filled, misses, pores = 0.0, 0, []
    while filled < target and misses < 20:
        r_a = float(rng.uniform(*c["pore_radius"]))
        centre = room.place(rng, r_a / pixel_size + 1.0)
        if centre is None:
            misses += 1
            continue
        pores.append((centre, r_a / pixel_size))
        filled += 4.0 / 3.0 * math.pi * r_a ** 3
    return pores


def _particles(rng: np.random.Generator, body: np.ndarray, half: np.ndarray, pixel_size: float) -> Polyhedra:
    """Heavy crystalline particles on the support's outer surface: FCC Wulff shapes (truncated
    octahedra, {111} faces at size/2, {100} at h100_over_h111 times that) of a size log-uniform in
    particle_size (A, across the {111} faces), randomly turned, centred half a {111} distance
    outside the surface (so they sit partly embedded); a Poisson number of mean particle_per_A2 x
    the support's area. Particles that would leave the box or touch another are left out."""
    c = CATALYST
    p_axes = body ** 1.6                                                  # Thomsen's ellipsoid area (within ~1 %)
    area = 4.0 * math.pi * ((p_axes[0] * p_axes[1] + p_axes[0] * p_axes[2] + p_axes[1] * p_axes[2]) / 3.0) ** (1 / 1.6)
    n = _count(c["particle_per_A2"], area * pixel_size ** 2, rng)
    lo, hi = (math.log(v) for v in c["particle_size"])
    centres, normals, offsets, radius = [], [], [], []
    for _ in range(n):
        h111 = math.exp(rng.uniform(lo, hi)) / 2.0 / pixel_size
        d = _unit(rng)
        surf = d / math.sqrt(float(np.sum((d / body) ** 2)))
        out = surf / body ** 2
        centre = surf + 0.5 * h111 * out / np.linalg.norm(out)
        rad = math.sqrt(3.0) * h111
        nrm, off = truncated_octahedron(h111, c["h100_over_h111"] * h111, _uniform_rotation(rng))
        if np.any(np.abs(centre) + rad > half - 0.5) or any(
                np.linalg.norm(centre - q) < rad + r for q, r in zip(centres, radius)):
            continue
        centres.append(centre)
        normals.append(nrm)
        offsets.append(off)
        radius.append(rad)
    k = len(centres)
    return Polyhedra(np.array(centres).reshape(k, 3), np.array(normals).reshape(k, 14, 3),
                     np.array(offsets).reshape(k, 14), np.array(radius), np.full(k, c["particle_density"]))


def catalyst(shape_zyx, pixel_size: float, seed: int) -> Specimen:
    """A porous, low-density support grain carrying heavy crystalline particles, in a box of
    ``shape_zyx`` voxels of ``pixel_size`` A (sizes and densities: :data:`CATALYST`; see
    docs/specimens.md)."""
    shape = tuple(int(s) for s in shape_zyx)
    half = np.array(shape[::-1], dtype=np.float64) / 2.0
    rng = _stream(seed, _CATALYST_STREAM, 0)
    body = half * rng.uniform(0.6, 0.72, size=3)
    if float(body.min()) < 2.0 * CATALYST["pore_radius"][0] / pixel_size:
        raise PhantomError(
            f"data.phantom=catalyst: the box (Z, Y, X) = {shape} voxels of {pixel_size:g} A is too small for the support "
            f"(its thinnest half size must hold {2 * CATALYST['pore_radius'][0]:g} A); raise data.pixel_size or the box "
            "(data.width, data.height, data.thickness).")
    room = _Room(body, half)
    pores = _pores(_stream(seed, _CATALYST_STREAM, 1), room, pixel_size)
    crystals = _particles(_stream(seed, _CATALYST_STREAM, 2), body, half, pixel_size)
    blobs = _texture(_stream(seed, _CATALYST_STREAM, 3), room, CATALYST, pixel_size, holes=pores)
    rho = CATALYST["support_density"]
    ells = [Ellipsoid((0.0, 0.0, 0.0), body, None, rho, "support")]
    ells += [Ellipsoid(c, (r,) * 3, None, -rho, f"pore {k}") for k, (c, r) in enumerate(pores)]
    sizes = [round(2.0 * float(o[0]) * pixel_size, 1) for o in crystals.offsets]
    parts = {"pixel_size_A": float(pixel_size), "support_semi_axes_A": [round(float(a) * pixel_size, 1) for a in body],
             "pores": len(pores), "particles": len(sizes), "particle_sizes_A": sizes, "texture_blobs": int(len(blobs.xyz))}
    return Specimen(shape, Phantom(shape, ells, margin=0.5, name="catalyst support"), blobs, crystals,
                    f"supported catalyst (seed {int(seed)})", parts)
