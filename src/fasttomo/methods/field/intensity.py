"""The intensity model: how a line integral becomes a measured pixel value.

    measured[view, pixel] = gain[view] * (line integral) + background + background_view[view]

in the sampler's normalized units (the stack divided by ``RaySampler.scale``). Real detectors add
an offset (camera pedestal, an imperfectly subtracted vacuum level, inelastic background), and the
beam current can drift from view to view; a field asked to explain an offset it cannot represent
fills the whole box with density instead (the bias that the first normalization default caused).

* ``background='fixed'`` (default): the robust vacuum estimate of :mod:`fasttomo.data.background`
  (or ``intensity.background_value``), not learned.
* ``background='learn'``: one offset, learned with the field, starting there. It trades against a
  uniform density in the box (both explain nearly the same data), so it can drift early in a fit;
  for data with no vacuum in the field of view, where the estimate is the thinnest specimen.
* ``background='learn_per_view'``: the global offset plus one learned offset per view, starting at
  each view's own vacuum estimate (for series whose vacuum level wanders between views).
* ``background='none'``: no offset (data that is already background-subtracted, by choice).
* ``gain_per_view``: a learned gain per view, exp(g[view]), with the reference view's fixed at 1
  (a common gain is the density's own scale, so one view must hold it).

The offsets are plain parameters (fp32, no autocast), cheap to evaluate and safe under DDP and CUDA
graphs: every parameter is indexed by the batch's view ids, so every step gives each one a
gradient (zero for views not in the batch).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

BACKGROUND_MODES = ("learn", "learn_per_view", "fixed", "none")


class Intensity(nn.Module):
    def __init__(self, n_views: int, reference_index: int, background: str = "fixed", offset: float = 0.0,
                 view_offsets: np.ndarray | None = None, gain_per_view: bool = False) -> None:
        """``offset`` (normalized units) is the starting global background; ``view_offsets``
        (n_views,) the starting per-view backgrounds (``learn_per_view``: the per-view parameter
        starts at ``view_offsets - offset``)."""
        super().__init__()
        if background not in BACKGROUND_MODES:
            raise ValueError(f"Intensity: background must be one of {list(BACKGROUND_MODES)}, got {background!r}")
        if not 0 <= reference_index < n_views:
            raise ValueError(f"Intensity: reference_index {reference_index} outside [0, {n_views})")
        self.mode = background
        self.gain_per_view = bool(gain_per_view)
        start = 0.0 if background == "none" else float(offset)
        self.offset = nn.Parameter(torch.tensor(start, dtype=torch.float32),
                                   requires_grad=background in ("learn", "learn_per_view"))
        per_view = torch.zeros(n_views)
        if background == "learn_per_view" and view_offsets is not None:
            per_view = torch.as_tensor(np.asarray(view_offsets, dtype=np.float64) - start, dtype=torch.float32)
        self.view_offset = nn.Parameter(per_view, requires_grad=background == "learn_per_view")
        self.log_gain = nn.Parameter(torch.zeros(n_views), requires_grad=self.gain_per_view)
        mask = torch.ones(n_views)
        mask[reference_index] = 0.0
        self.register_buffer("gain_mask", mask)

    def forward(self, integral: torch.Tensor, tilt: torch.Tensor) -> torch.Tensor:
        """(B,) line integrals of views ``tilt`` (B,) -> (B,) predicted measurements (fp32)."""
        out = integral
        if self.gain_per_view:
            out = out * torch.exp(self.log_gain * self.gain_mask)[tilt]
        if self.mode == "none":
            return out
        out = out + self.offset
        if self.mode == "learn_per_view":
            out = out + self.view_offset[tilt]
        return out

    @torch.no_grad()
    def describe(self, scale: float = 1.0) -> dict:
        """Values in the units of the input stack (times ``scale``), for metrics.json (host sync)."""
        d = {"background_mode": self.mode, "background": float(self.offset) * scale if self.mode != "none" else 0.0}
        if self.mode == "learn_per_view":
            d["background_per_view"] = ((self.offset + self.view_offset).double().cpu() * scale).tolist()
        if self.gain_per_view:
            d["gain_per_view"] = torch.exp(self.log_gain * self.gain_mask).double().cpu().tolist()
        return d
