"""Scoring a trace against true coordinates: precision, recall, RMSD, species accuracy."""

from __future__ import annotations

import numpy as np
import torch

from fasttomo.trace.neighbors import greedy_match, nearest_neighbour_distances


def score_trace(traced_xyz_A, true_xyz_A, *, voxel_size_A: float, traced_species=None, true_species=None,
                match_radius_A: float | None = None) -> dict:
    """Match traced to true atoms one to one, greedily by distance, within ``match_radius_A``
    (default: half the median nearest-neighbour distance of the true atoms) and score.

    Returns precision (matched / traced), recall (matched / true), the RMSD of the matched pairs
    in Angstrom and in voxels, the match radius and, when both sides have species (values >= 1)
    and the truth more than one, the species accuracy of the matched atoms (species are numbered
    in increasing order of intensity on both sides).
    """
    a = torch.as_tensor(np.asarray(traced_xyz_A, dtype=np.float64).reshape(-1, 3))
    b = torch.as_tensor(np.asarray(true_xyz_A, dtype=np.float64).reshape(-1, 3))
    out: dict = {"n_traced": int(a.shape[0]), "n_true": int(b.shape[0])}
    nn = nearest_neighbour_distances(b, guess=4.0 * voxel_size_A)
    finite = nn[torch.isfinite(nn)]
    nn_med = float(finite.median()) if finite.numel() else float("nan")
    out["true_nearest_neighbour_A"] = nn_med
    if match_radius_A is None:
        match_radius_A = 0.5 * nn_med if np.isfinite(nn_med) else 2.0 * voxel_size_A
        out["match_radius_source"] = "half the median nearest-neighbour distance of the true atoms"
    else:
        out["match_radius_source"] = "match_radius_A="
    out["match_radius_A"] = float(match_radius_A)
    ia, ib, d = greedy_match(a, b, float(match_radius_A))
    m = int(ia.numel())
    out["n_matched"] = m
    out["precision"] = m / a.shape[0] if a.shape[0] else float("nan")
    out["recall"] = m / b.shape[0] if b.shape[0] else float("nan")
    rmsd = float(torch.sqrt((d ** 2).mean())) if m else float("nan")
    out["rmsd_A"] = rmsd
    out["rmsd_voxels"] = rmsd / voxel_size_A
    if m:
        diff = (a[ia] - b[ib]).numpy()
        out["mean_offset_A"] = diff.mean(axis=0).tolist()  # x, y, z: a systematic shift shows here
        out["rmsd_xyz_A"] = np.sqrt((diff ** 2).mean(axis=0)).tolist()
    if traced_species is not None and true_species is not None and m:
        ts = np.asarray(traced_species)[ia.numpy()]
        gs = np.asarray(true_species)[ib.numpy()]
        if np.all(gs >= 1) and len(np.unique(np.asarray(true_species))) > 1 and np.all(ts >= 1):
            out["species_accuracy"] = float((ts == gs).mean())
    return out
