"""Helpers for the alignment-file tests (imported as align_helpers): IMOD's .xf and AreTomo's .aln
written from their documented definitions, and newstack -xf applied to images, all independent
of fasttomo's own alignment code.

IMOD's .xf: per section A11 A12 A21 A22 DX DY; the aligned image at (x', y') shows the raw image
at (x, y) where (x', y') = A (x, y) + (DX, DY), both measured from the image centre (nx/2, ny/2)
in IMOD's pixel coordinates (a pixel's centre at index + 0.5; x along the columns, y along the rows
in file order). AreTomo's .aln: A = GMAG R(ROT), (DX, DY) = -A (TX, TY)."""

from __future__ import annotations

import numpy as np


def rot(a_deg: float) -> np.ndarray:
    a = np.deg2rad(a_deg)
    return np.array([[np.cos(a), -np.sin(a)], [np.sin(a), np.cos(a)]])


def write_xf(path, mats, shifts) -> str:
    """An .xf of per-section 2x2 ``mats`` and (DX, DY) ``shifts``, in IMOD's column format."""
    lines = ["".join(f"{v:12.7f}" for v in np.asarray(a).ravel()) + "".join(f"{v:12.3f}" for v in d)
             for a, d in zip(mats, shifts)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def write_aln(path, rot_deg, tx_ty, tilts, raw_size, gmag=None, darks=()) -> str:
    """An AreTomo .aln (global alignment only) as AreTomo writes it."""
    gmag = np.ones(len(rot_deg)) if gmag is None else gmag
    head = ["# AreTomo Alignment / Priims bprmMn", f"# RawSize = {raw_size[0]} {raw_size[1]} {raw_size[2]}",
            "# NumPatches = 0", *[f"# DarkFrame =     {i}    {i}   {t:8.2f}" for i, t in darks],
            "# AlphaOffset =     0.00", "# BetaOffset =     0.00",
            "# SEC     ROT         GMAG       TX          TY      SMEAN     SFIT    SCALE     BASE     TILT"]
    rows = [f"{k:5d}  {r:9.4f}  {g:9.5f}  {tx:9.3f}  {ty:9.3f}     1.00     1.00     1.00     0.00  {t:8.2f}"
            for k, (r, g, (tx, ty), t) in enumerate(zip(rot_deg, gmag, tx_ty, tilts))]
    path.write_text("\n".join(head + rows) + "\n")
    return str(path)


def _bilinear(img: np.ndarray, row: np.ndarray, col: np.ndarray) -> np.ndarray:
    h, w = img.shape
    r0, c0 = np.floor(row).astype(int), np.floor(col).astype(int)
    fr, fc = row - r0, col - c0
    out = np.zeros(row.shape)
    for dr, wr in ((0, 1 - fr), (1, fr)):
        for dc, wc in ((0, 1 - fc), (1, fc)):
            rr, cc = r0 + dr, c0 + dc
            ok = (rr >= 0) & (rr < h) & (cc >= 0) & (cc < w)
            out += np.where(ok, img[np.clip(rr, 0, h - 1), np.clip(cc, 0, w - 1)], 0.0) * wr * wc
    return out


def newstack_xf(raw: np.ndarray, mats, shifts) -> np.ndarray:
    """The aligned stack newstack -xf makes of ``raw`` (n, H, W): output pixel (x', y') takes the
    input at A^-1 ((x', y') - d) about the centre (bilinear; outside the image: 0)."""
    n, h, w = raw.shape
    rows, cols = np.mgrid[:h, :w].astype(np.float64)
    xq, yq = cols + 0.5 - w / 2, rows + 0.5 - h / 2  # IMOD coordinates from the centre
    out = np.empty(raw.shape, dtype=np.float32)
    for i in range(n):
        inv = np.linalg.inv(np.asarray(mats[i]))
        px, py = xq - shifts[i][0], yq - shifts[i][1]
        x, y = inv[0, 0] * px + inv[0, 1] * py, inv[1, 0] * px + inv[1, 1] * py
        out[i] = _bilinear(raw[i].astype(np.float64), y + h / 2 - 0.5, x + w / 2 - 0.5)
    return out


def blob_images(points_rc, h: int, w: int, sigma: float = 1.2) -> np.ndarray:
    """(n, H, W) Gaussian blobs centred at (row, col) positions (one per image)."""
    rows, cols = np.mgrid[:h, :w]
    return np.stack([np.exp(-((rows - r) ** 2 + (cols - c) ** 2) / (2 * sigma**2)) for r, c in points_rc]
                    ).astype(np.float32)
