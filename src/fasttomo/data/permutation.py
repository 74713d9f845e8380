"""Keyed permutations of ``[0, n)`` evaluated at any positions, without a list of all ``n``.

The ray sampler's ``order=hashed`` (series above 2^24 pixels) draws its train/validation split and
each epoch's order from these instead of ``torch.randperm``: a 2048^2 x 121 series has 507 M
pixels, and a materialized permutation of them is a 4 GB int64 list that takes tens of seconds to
draw and sort on a CPU, for a run that visits a tenth of it.

A :class:`FeistelPermutation` is a balanced Feistel network over ``2h`` bits (``4^h >= n``) with
a 32-bit integer hash as round function, restricted to ``[0, n)`` by cycle walking: a value that
lands at or beyond ``n`` is encrypted again until it falls inside, which is a bijection of
``[0, n)`` (the inverse walks with the inverse network). Everything is int64 tensor arithmetic
whose intermediate values stay below 2^63, so the CPU and a GPU give the same integers.
"""

from __future__ import annotations

import torch

__all__ = ["FeistelPermutation", "round_keys", "splitmix64"]

ROUNDS = 6
_M32 = 0xFFFF_FFFF
_M64 = 0xFFFF_FFFF_FFFF_FFFF


def splitmix64(x: int) -> int:
    """SplitMix64's output function of a 64-bit integer."""
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def round_keys(*words: int, rounds: int = ROUNDS) -> list[int]:
    """``rounds`` 31-bit keys, a pure function of the integer ``words`` (seed, epoch, ...)."""
    state = 0
    for w in words:
        state = splitmix64(state ^ (int(w) & _M64))
    keys = []
    for _ in range(rounds):
        state = splitmix64(state)
        keys.append(state >> 33)
    return keys


def _hash32(x: torch.Tensor, key: int) -> torch.Tensor:
    """A 32-bit mix of ``x`` (int64 in [0, 2^32)) and ``key`` (< 2^31); products stay < 2^63."""
    h = (x + key) & _M32
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x68E31DA5) & _M32
    return h ^ (h >> 16)


class FeistelPermutation:
    """A bijection of ``[0, n)`` keyed by ``keys`` (see :func:`round_keys`); ``perm(x)`` maps an
    int64 tensor of positions, ``perm(x, inverse=True)`` maps them back."""

    def __init__(self, n: int, keys: list[int]) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = int(n)
        self.keys = list(keys)
        self.half = max(1, -(-max(1, (self.n - 1).bit_length()) // 2))
        self.mask = (1 << self.half) - 1

    def _network(self, x: torch.Tensor, inverse: bool) -> torch.Tensor:
        h, m = self.half, self.mask
        left, right = x >> h, x & m
        if not inverse:
            for k in self.keys:
                left, right = right, left ^ (_hash32(right, k) & m)
        else:
            for k in reversed(self.keys):
                left, right = right ^ (_hash32(left, k) & m), left
        return (left << h) | right

    def __call__(self, x: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        y = self._network(x, inverse)
        out = torch.nonzero(y >= self.n).squeeze(1)
        while out.numel():  # cycle walking: each value leaves the [n, 4^h) tail after a few passes
            y[out] = self._network(y[out], inverse)
            out = out[y[out] >= self.n]
        return y
