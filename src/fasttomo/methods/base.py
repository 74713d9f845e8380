"""The interface every reconstruction method offers a run (the neural field, SIRT).

A run (fasttomo.run.run.Run) makes one method for ``model.kind`` after its input checks, then
calls, in this order: :meth:`Method.load` (a resume only), :meth:`Method.check_space` (rank 0),
:meth:`Method.fit`, :meth:`Method.export` and :meth:`Method.state` (collective: every rank calls
them), :meth:`Method.summary` and :meth:`Method.scores` (rank 0). The half sets make a fresh method
per half and call :meth:`Method.fit` and :meth:`Method.export` on it.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class Method(Protocol):
    """A reconstruction method inside a run."""

    cfg: object
    """The run's config as the method sized it from the data (e.g. optim.steps=None resolved)."""
    label: str
    """Shown after the run's name in report.png's title ("" for the field, "SIRT")."""
    step: int
    """Steps (iterations) done so far; the manifest records it when the run ends."""

    def load(self, state: dict, source: str) -> None:
        """Continue from a checkpoint's ``state`` (``source`` names it in errors)."""

    def check_space(self, out_dir) -> None:
        """Refuse (OutputFolderError) a run folder without room for the run's files (rank 0)."""

    def fit(self) -> None:
        """Reconstruct (may stop early on a stop request, or raise DivergenceError)."""

    def export(self) -> tuple[np.ndarray | None, int]:
        """(the volume (Z, Y, X) float32 in stack units per voxel, the step it is of); None on the
        ranks other than 0. Collective."""

    # optional: export_files(out_dir, attrs) -> (volume, step, written, failed, finite), a method
    # that writes its volume files as it evaluates the volume (the field: slab by slab into
    # volume.mrc); optional: volume_slabs(planes_of), a context giving (shape, Z planes a slab,
    # slabs of the volume on the device), which the run (one process, mrc among the formats) writes
    # slab by slab, as it does every method's half volumes; else the run writes what :meth:`export`
    # returns

    def state(self) -> dict | None:
        """The checkpoint of the run so far, None when the method keeps none. Collective."""

    def summary(self, volume: np.ndarray) -> dict:
        """metrics.json's entries of the fit (speed, device, sizes, intensity, poses) (rank 0)."""

    def scores(self, metrics: dict, exported_step: int) -> None:
        """The method's evaluation entries (held-out views, residuals, curve, ...) into ``metrics``
        (rank 0)."""

    def release(self) -> None:
        """After the scores, before the half sets' fits: give back the device memory the run reads
        no more (SIRT's volume; the field's trainer and its data). ``step`` keeps its value."""
