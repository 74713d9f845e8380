"""Run logging: a rank-0 TensorBoard writer, a tqdm progress bar and the run's log file.

Everything here is a no-op on ranks other than 0, so callers never branch on the rank.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np

log = logging.getLogger("fasttomo")


def add_file_log(path: Path, overwrite: bool = False, append: bool = False) -> logging.Handler:
    """Send the 'fasttomo' loggers to ``path`` too (opened after the output folder was checked;
    an existing log is replaced only when the user asked to overwrite, and appended to when a
    run continues in its own folder)."""
    handler = logging.FileHandler(path, mode="a" if append else "w" if overwrite else "x", encoding="utf-8")
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] %(message)s"))
    logging.getLogger("fasttomo").addHandler(handler)
    logging.getLogger("fasttomo").setLevel(logging.INFO)
    return handler


def to_uint8(img: np.ndarray, lo: float | None = None, hi: float | None = None) -> np.ndarray:
    """Scale an image to 0..255 (percentile window 0.5-99.5 unless lo/hi given)."""
    img = np.asarray(img, dtype=np.float32)
    if lo is None or hi is None:
        lo, hi = np.percentile(img, [0.5, 99.5])
    if hi <= lo:
        hi = lo + 1e-6
    return (np.clip((img - lo) / (hi - lo), 0, 1) * 255).astype(np.uint8)


class RunLogger:
    """TensorBoard scalars/images and a progress bar, active on the main rank only."""

    def __init__(self, out_dir: Path | None, *, main: bool, tensorboard: bool, progress: bool, total: int,
                 initial: int = 0):
        self.main = main
        self.writer = None
        self.bar = None
        if main and tensorboard and out_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(Path(out_dir) / "tb"))
        if main and progress:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, initial=initial, desc="reconstruct", unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        if self.writer is not None:
            for k, v in values.items():
                self.writer.add_scalar(k, v, step)

    def image(self, step: int, tag: str, img: np.ndarray) -> None:
        """A 2-D float image, windowed to uint8 (HW)."""
        if self.writer is not None:
            self.writer.add_image(tag, to_uint8(img), step, dataformats="HW")

    def progress(self, n: int = 1, **postfix) -> None:
        if self.bar is not None:
            self.bar.update(n)
            if postfix:
                self.bar.set_postfix(postfix, refresh=False)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
