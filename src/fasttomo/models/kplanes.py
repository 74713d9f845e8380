"""KPlanesTILTED: multi-scale K-Planes sampled in T rotated frames, decoded by a small MLP.

For a normalized point p in [-1, 1]^3 and frame t, the planes are sampled at q_t = M_t p with

    M_t = R_t / extent,   extent = sqrt(3) for rotated (learned or random) frames, 1 otherwise.

A rotated unit cube R [-1, 1]^3 reaches |q_i| = sqrt(3) (its corners), so dividing by sqrt(3)
keeps every rotated point inside the planes' [-1, 1] range instead of being clamped at the border
(the price: about 1/sqrt(3) of each plane's texels along an axis is used by the box's centre
line). Plain K-Planes (T = 1, learn_frames = False, identity frame) keeps extent = 1 so its
texels line up with the box exactly. Frame 0 starts at the identity, frames 1..T-1 at random
rotations; when ``learn_frames`` all T are learned (param ``svd``: a free 3x3 matrix projected
onto SO(3); ``quaternion``: a 4-vector normalized inside), otherwise they are frozen.

Features come from ``fasttomo.kernels.dispatch.tilted_kplanes`` (layout: one flat, channels-last
``plane_data`` parameter, see :mod:`fasttomo.kernels.layout`), then the decoder and the density
activation. Rotation math runs with autocast disabled, in the parameters' dtype (fp32).
"""

from __future__ import annotations

import dataclasses
import math

import torch
from torch import nn

from fasttomo.config import KPlanesConfig, option_keys
from fasttomo.geometry.so3 import random_quaternions, rotation_from_matrix, rotation_from_quaternion
from fasttomo.kernels import dispatch
from fasttomo.kernels.layout import PlaneLayout
from fasttomo.models.decoder import Decoder, density_activation

_MODEL_KEYS = tuple(k for k in option_keys(KPlanesConfig) if k != "kind")
"""The KPlanesConfig fields, the keyword arguments of KPlanesTILTED."""


class KPlanesTILTED(nn.Module):
    def __init__(self, cfg: KPlanesConfig | None = None, *, generator: torch.Generator | None = None,
                 **overrides) -> None:
        """Build from a ``KPlanesConfig`` and/or explicit keyword arguments (any of its fields in
        ``_MODEL_KEYS``: n_rotations, learn_frames, rotation_param, channels, resolutions, decoder,
        hidden, activation, density_shift, init_low, init_high; they override ``cfg`` and are
        validated by it). ``generator`` drives the random init (default: torch's global RNG)."""
        super().__init__()
        unknown = sorted(set(overrides) - set(_MODEL_KEYS))
        if unknown:
            raise TypeError(f"KPlanesTILTED: unknown argument(s) {unknown}; valid: {list(_MODEL_KEYS)}")
        cfg = dataclasses.replace(cfg or KPlanesConfig(), kind="kplanes_tilted", **overrides)
        self.cfg = cfg
        T = cfg.n_rotations
        self.layout = PlaneLayout(n_rot=T, channels=cfg.channels, resolutions=cfg.resolution_triples())
        self.learn_frames = cfg.learn_frames
        self.rotation_param = cfg.rotation_param
        self.activation = cfg.activation
        self.density_shift = float(cfg.density_shift)
        self.plain = T == 1 and not cfg.learn_frames
        self.extent = 1.0 if self.plain else math.sqrt(3.0)

        plane = torch.empty(self.layout.numel)
        plane.uniform_(cfg.init_low, cfg.init_high, generator=generator)
        self.plane_data = nn.Parameter(plane)

        q = torch.zeros(T, 4)
        q[0, 0] = 1.0
        if T > 1:
            q[1:] = random_quaternions(T - 1, generator=generator)
        init = q if self.rotation_param == "quaternion" else rotation_from_quaternion(q)
        self.rot_params = nn.Parameter(init, requires_grad=self.learn_frames)

        self.decoder = Decoder(self.layout.n_features, cfg.decoder, cfg.hidden, generator=generator)
        self.planes_bf16 = False
        """Sample the planes' values rounded to bf16 (precision.planes=bf16, set by the run's build)."""

    @property
    def n_features(self) -> int:
        return self.layout.n_features

    def rotation_matrices(self) -> torch.Tensor:
        """(T, 3, 3) frame rotations R_t (exactly orthonormal, det +1)."""
        with torch.autocast(device_type=self.rot_params.device.type, enabled=False):
            if self.rotation_param == "quaternion":
                return rotation_from_quaternion(self.rot_params)
            if not self.learn_frames:
                # frozen 'svd' parameters were created as exact rotations and never change: skip the
                # per-step SVD (on CUDA it synchronizes with the host)
                return self.rot_params
            return rotation_from_matrix(self.rot_params)

    def sampling_matrices(self) -> torch.Tensor:
        """(T, 3, 3) M_t = R_t / extent handed to the interpolation op."""
        with torch.autocast(device_type=self.rot_params.device.type, enabled=False):
            r = self.rotation_matrices()
            return r if self.plain else r * (1.0 / self.extent)

    def features(self, points: torch.Tensor) -> torch.Tensor:
        """(N, 3) normalized xyz -> (N, L*T*C) plane features."""
        m = self.sampling_matrices()
        return dispatch.tilted_kplanes(points.to(m.dtype), m, self.plane_data, self.layout, self.planes_bf16)

    def forward(self, points: torch.Tensor, plane_tv: bool = False):
        """Density at normalized points (..., 3) -> (...); with ``plane_tv`` also the planes' TV
        (:meth:`plane_tv`) from the same call: (density, TV), which a training step's backward
        takes in one pass on the GPU (``dispatch.tilted_kplanes_tv``)."""
        lead = points.shape[:-1]
        flat = points.reshape(-1, 3)
        tv = None
        if plane_tv:
            m = self.sampling_matrices()
            feats, tv = dispatch.tilted_kplanes_tv(flat.to(m.dtype), m, self.plane_data, self.layout, self.planes_bf16)
        else:
            feats = self.features(flat)
        density = density_activation(self.decoder(feats), self.activation, self.density_shift).reshape(lead)
        return (density, tv) if plane_tv else density

    def plane_tv(self) -> torch.Tensor:
        return dispatch.plane_tv(self.plane_data, self.layout)

    def param_groups(self) -> dict[str, list[nn.Parameter]]:
        """Parameters by optimizer group; 'rotations' is empty when the frames are frozen."""
        return {
            "grids": [self.plane_data],
            "decoder": list(self.decoder.parameters()),
            "rotations": [self.rot_params] if self.learn_frames else [],
        }
