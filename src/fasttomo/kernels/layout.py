"""Static layout of the multi-scale K-Planes parameters in one flat buffer.

All planes of all scales live in ONE flat fp32 parameter ``plane_data`` so fused kernels read and
write a single buffer. For scale ``l`` and plane kind ``k`` (0 = xy, 1 = xz, 2 = yz) the T planes of
the T rotations are stored back to back, each channels-last (H, W, C):

    plane_data[offset[l][k] + t*H*W*C : offset[l][k] + (t+1)*H*W*C].view(H, W, C)

Plane kind k samples the rotated point q = M_t p at (column, row) = (q[a], q[b]) with
(a, b) = (0, 1), (0, 2), (1, 2): xy uses x for W and y for H, xz uses x/z, yz uses y/z.
Feature ordering of the op output: index = l*T*C + t*C + c.

This class is the ONLY place plane offsets are computed: the pure-torch twins, the Triton launchers
(``kernels/triton/kplanes.py``, ``kernels/triton/tv.py``) and the custom ops (which carry the layout
as ``(n_rot, channels, flat_resolutions)`` because torch custom ops take no dataclasses, and turn it
back into a ``PlaneLayout`` with ``from_flat``) all read ``offsets`` / ``scales()`` / ``groups()``.
"""

from __future__ import annotations

import dataclasses

# (column axis, row axis) of each plane kind
PLANE_AXES: tuple[tuple[int, int], ...] = ((0, 1), (0, 2), (1, 2))


@dataclasses.dataclass(frozen=True)
class PlaneLayout:
    n_rot: int
    """T: number of rotated frames."""
    channels: int
    """C: channels per plane."""
    resolutions: tuple[tuple[int, int, int], ...]
    """Per scale: (rx, ry, rz) grid resolution along x, y, z (plane sizes derive from it)."""

    def __post_init__(self) -> None:
        if self.n_rot < 1 or self.channels < 1 or not self.resolutions:
            raise ValueError(f"PlaneLayout needs T>=1, C>=1 and >=1 scale, got {self}")
        for r in self.resolutions:
            if len(r) != 3 or min(r) < 2:
                raise ValueError(f"PlaneLayout: every resolution must be 3 ints >= 2, got {r}")

    @classmethod
    def from_flat(cls, n_rot: int, channels: int, flat_resolutions) -> "PlaneLayout":
        """The inverse of ``flat_resolutions``: (rx0, ry0, rz0, rx1, ...) back to a layout."""
        r = [int(v) for v in flat_resolutions]
        if len(r) % 3:
            raise ValueError(f"PlaneLayout.from_flat: {len(r)} resolution values, need 3 per scale")
        return cls(int(n_rot), int(channels), tuple(tuple(r[3 * i: 3 * i + 3]) for i in range(len(r) // 3)))

    @property
    def flat_resolutions(self) -> list[int]:
        """(rx0, ry0, rz0, rx1, ...): how the custom ops carry the resolutions."""
        return [v for r in self.resolutions for v in r]

    @property
    def n_scales(self) -> int:
        return len(self.resolutions)

    def plane_shape(self, scale: int, kind: int) -> tuple[int, int]:
        """(H, W) of plane ``kind`` at ``scale``: W along the column axis, H along the row axis."""
        a, b = PLANE_AXES[kind]
        r = self.resolutions[scale]
        return r[b], r[a]

    @property
    def offsets(self) -> tuple[tuple[int, int, int], ...]:
        """offsets[l][k]: start of the T planes of kind k at scale l in the flat buffer."""
        out, pos = [], 0
        for l in range(self.n_scales):
            row = []
            for k in range(3):
                row.append(pos)
                h, w = self.plane_shape(l, k)
                pos += self.n_rot * h * w * self.channels
            out.append(tuple(row))
        return tuple(out)

    def scales(self):
        """Per scale l: (l, rx, ry, rz, off_xy, off_xz, off_yz), what one kernel launch needs."""
        for l, (rx, ry, rz) in enumerate(self.resolutions):
            yield (l, rx, ry, rz) + self.offsets[l]

    def groups(self):
        """Per (scale, plane kind), in buffer order: (offset, H, W, numel of the T planes)."""
        for l in range(self.n_scales):
            for k in range(3):
                h, w = self.plane_shape(l, k)
                yield self.offsets[l][k], h, w, self.n_rot * h * w * self.channels

    @property
    def numel(self) -> int:
        h, w = self.plane_shape(self.n_scales - 1, 2)
        return self.offsets[-1][2] + self.n_rot * h * w * self.channels

    @property
    def n_features(self) -> int:
        return self.n_scales * self.n_rot * self.channels

    def view(self, plane_data, scale: int, kind: int):
        """The (T, H, W, C) view of one plane kind at one scale (no copy)."""
        h, w = self.plane_shape(scale, kind)
        o = self.offsets[scale][kind]
        n = self.n_rot * h * w * self.channels
        return plane_data[o : o + n].view(self.n_rot, h, w, self.channels)

    def kind_runs(self, scale: int):
        """Runs of consecutive plane kinds at ``scale`` that share (H, W), as (k0, k1, H, W) with
        kinds k0..k1-1: their planes are back to back in the buffer, so one run is one batch of
        (k1-k0)*T planes (all 3 kinds for a cubic resolution)."""
        runs = []
        for k in range(3):
            hw = self.plane_shape(scale, k)
            if runs and runs[-1][2:] == hw:
                runs[-1] = (runs[-1][0], k + 1) + hw
            else:
                runs.append((k, k + 1) + hw)
        return runs

    def view_kinds(self, plane_data, scale: int, k0: int, k1: int):
        """The ((k1-k0)*T, H, W, C) view of plane kinds k0..k1-1 at one scale (no copy); they must
        share (H, W) (a run of ``kind_runs``)."""
        h, w = self.plane_shape(scale, k0)
        if any(self.plane_shape(scale, k) != (h, w) for k in range(k0, k1)):
            raise ValueError(f"PlaneLayout.view_kinds: kinds {k0}..{k1 - 1} of scale {scale} differ in (H, W)")
        o = self.offsets[scale][k0]
        n = (k1 - k0) * self.n_rot * h * w * self.channels
        return plane_data[o : o + n].view((k1 - k0) * self.n_rot, h, w, self.channels)
