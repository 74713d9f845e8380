"""Point pairs closer than a radius (a uniform-grid hash, torch, CPU or GPU), the greedy
suppression of duplicates and the greedy nearest matching built on it."""

from __future__ import annotations

import torch


def pairs_within(a: torch.Tensor, b: torch.Tensor, radius: float, same: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """All pairs (i, j) with |a_i - b_j| < ``radius``: points (N, 3), (M, 3) in any one unit.

    Points are hashed into cubic cells of side ``radius``; only the 27 neighbouring cells are
    compared, so the work grows with the number of close pairs, not N x M. With ``same`` (b is a)
    only pairs i < j are returned. Returns ``(i, j, distance)``.
    """
    dev = a.device
    empty = (torch.zeros(0, dtype=torch.long, device=dev),) * 2 + (torch.zeros(0, dtype=a.dtype, device=dev),)
    if a.shape[0] == 0 or b.shape[0] == 0 or not radius > 0:
        return empty
    lo = torch.minimum(a.min(0).values, b.min(0).values)
    ca = torch.floor((a - lo) / radius).long() + 1
    cb = torch.floor((b - lo) / radius).long() + 1
    dims = torch.maximum(ca.max(0).values, cb.max(0).values) + 2

    def key(c):
        return (c[:, 0] * dims[1] + c[:, 1]) * dims[2] + c[:, 2]

    kb = key(cb)
    kb_sorted, order = torch.sort(kb)
    ii, jj = [], []
    r = torch.arange(-1, 2, device=dev)
    offsets = torch.stack(torch.meshgrid(r, r, r, indexing="ij"), dim=-1).reshape(-1, 3)
    idx_a = torch.arange(a.shape[0], device=dev)
    for off in offsets:
        k = key(ca + off)
        start = torch.searchsorted(kb_sorted, k, right=False)
        end = torch.searchsorted(kb_sorted, k, right=True)
        cnt = end - start
        total = int(cnt.sum())
        if total == 0:
            continue
        ia = torch.repeat_interleave(idx_a, cnt)
        first = torch.repeat_interleave(start, cnt)
        seg = torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
        jb = order[first + torch.arange(total, device=dev) - seg]
        ii.append(ia)
        jj.append(jb)
    if not ii:
        return empty
    i, j = torch.cat(ii), torch.cat(jj)
    if same:
        keep = i < j
        i, j = i[keep], j[keep]
    d = torch.linalg.vector_norm(a[i] - b[j], dim=-1)
    keep = d < radius
    return i[keep], j[keep], d[keep]


def greedy_suppress(points: torch.Tensor, score: torch.Tensor, radius: float) -> torch.Tensor:
    """Keep-mask of the greedy suppression: in order of decreasing ``score``, a point is kept
    unless a kept point lies closer than ``radius`` (ties broken by the lower index).

    Computed in parallel rounds (every undecided point that outranks all its undecided
    neighbours is kept, its neighbours dropped), which gives exactly the sequential result.
    """
    n = points.shape[0]
    dev = points.device
    keep = torch.ones(n, dtype=torch.bool, device=dev)
    i, j, _ = pairs_within(points, points, radius, same=True)
    if i.numel() == 0:
        return keep
    rank = torch.empty(n, dtype=torch.long, device=dev)
    order = torch.argsort(score, descending=True, stable=True)
    rank[order] = torch.arange(n, device=dev)                       # 0 = best
    undecided = torch.zeros(n, dtype=torch.bool, device=dev)
    undecided[i] = True
    undecided[j] = True
    for _ in range(n + 1):
        live = undecided[i] & undecided[j]
        if not bool(undecided.any()):
            break
        li, lj = i[live], j[live]
        best_nb = torch.full((n,), n, dtype=torch.long, device=dev)     # the best rank among live neighbours
        best_nb.scatter_reduce_(0, li, rank[lj], reduce="amin")
        best_nb.scatter_reduce_(0, lj, rank[li], reduce="amin")
        winner = undecided & (rank < best_nb)
        undecided &= ~winner
        loser = torch.zeros(n, dtype=torch.bool, device=dev)
        loser[lj[winner[li]]] = True
        loser[li[winner[lj]]] = True
        loser &= undecided
        keep &= ~loser
        undecided &= ~loser
    return keep


def greedy_match(a: torch.Tensor, b: torch.Tensor, radius: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One-to-one matching of points ``a`` to ``b`` closer than ``radius``, greedy by distance
    (the closest pair first). Returns matched indices ``(ia, ib)`` and their distances."""
    i, j, d = pairs_within(a, b, radius)
    dev = a.device
    ma = torch.full((a.shape[0],), -1, dtype=torch.long, device=dev)
    mb = torch.full((b.shape[0],), -1, dtype=torch.long, device=dev)
    if i.numel():
        # sequential greedy over the pairs sorted by distance (ties: by index), in parallel rounds of
        # mutually nearest pairs, which is the same result
        order = torch.argsort(d, stable=True)
        i, j, d = i[order], j[order], d[order]
        pr = torch.arange(i.numel(), device=dev)
        while i.numel():
            big = i.numel()
            best_a = torch.full((a.shape[0],), big, dtype=torch.long, device=dev).scatter_reduce_(0, i, pr, "amin")
            best_b = torch.full((b.shape[0],), big, dtype=torch.long, device=dev).scatter_reduce_(0, j, pr, "amin")
            mutual = (best_a[i] == pr) & (best_b[j] == pr)
            ma[i[mutual]] = j[mutual]
            mb[j[mutual]] = i[mutual]
            live = (ma[i] < 0) & (mb[j] < 0)
            i, j, d = i[live], j[live], d[live]
            pr = torch.arange(i.numel(), device=dev)
    ia = torch.nonzero(ma >= 0).flatten()
    ib = ma[ia]
    dist = torch.linalg.vector_norm(a[ia] - b[ib], dim=-1) if ia.numel() else torch.zeros(0, device=dev)
    return ia, ib, dist


def nearest_neighbour_distances(points: torch.Tensor, guess: float) -> torch.Tensor:
    """Distance from each point to its nearest other point (inf when none is found within a
    radius grown from ``guess`` until at least 90 % of the points have a neighbour)."""
    n = points.shape[0]
    out = torch.full((n,), float("inf"), dtype=points.dtype, device=points.device)
    if n < 2:
        return out
    r = float(guess)
    for _ in range(40):
        i, j, d = pairs_within(points, points, r, same=True)
        out.fill_(float("inf"))
        out.scatter_reduce_(0, i, d, "amin")
        out.scatter_reduce_(0, j, d, "amin")
        if bool((torch.isfinite(out).float().mean() >= 0.9)):
            return out
        r *= 1.5
    return out
