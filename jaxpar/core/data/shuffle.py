"""Grain's index shuffle, per index.

Position i of a pseudo-random permutation of range(n) keyed by a seed, with nothing of size n materialised (the data
order of windows, data_order.py, and of length buckets, buckets.py).
"""

from __future__ import annotations

import functools
import math


_MASK32 = (1 << 32) - 1


@functools.lru_cache(maxsize=64)
def _round_keys(seed: int, rounds: int) -> tuple[int, ...]:
    """`rounds` 32-bit words from `seed` by C++'s std::seed_seq algorithm ([rand.util.seedseq])."""
    n, v = rounds, (seed,)
    out = [0x8B8B8B8B] * n
    t = 11 if n >= 623 else 7 if n >= 68 else 5 if n >= 39 else 3 if n >= 7 else (n - 1) // 2
    p, m = (n - t) // 2, max(len(v) + 1, n)
    q = p + t
    mix = lambda x: x ^ (x >> 27)
    for k in range(m):
        r1 = 1664525 * mix(out[k % n] ^ out[(k + p) % n] ^ out[(k - 1) % n]) & _MASK32
        r2 = (r1 + (len(v) if k == 0 else k % n + v[k - 1] if k <= len(v) else k % n)) & _MASK32
        out[(k + p) % n] = (out[(k + p) % n] + r1) & _MASK32
        out[(k + q) % n] = (out[(k + q) % n] + r2) & _MASK32
        out[k % n] = r2
    for k in range(m, m + n):
        r3 = 1566083941 * mix((out[k % n] + out[(k + p) % n] + out[(k - 1) % n]) & _MASK32) & _MASK32
        r4 = (r3 - k % n) & _MASK32
        out[(k + p) % n] ^= r3
        out[(k + q) % n] ^= r4
        out[k % n] = r4
    return tuple(out)


def shuffled_index(i: int, n: int, seed: int, rounds: int = 4) -> int:
    """Position i of a pseudo-random permutation of range(n) keyed by a 32-bit seed.

    A Simon-style Feistel cipher on the smallest even block (at least 16 bits) covering n - 1, re-applied until the
    value falls below n (cycle walking keeps it a bijection). It is grain's index shuffle, so runs keep the data
    order they had when jaxpar read its data through grain's MapDataset.shuffle.
    """
    if n == 1:
        return 0
    block = max(math.ceil(math.log2(n - 1)), 1)
    w = max(block + block % 2, 16) // 2
    mask = (1 << w) - 1
    rot = lambda x, r: ((x << r) | (x >> (w - r))) & mask
    f = lambda x: (rot(x, 1) & rot(x, 8)) ^ rot(x, 2)
    keys = _round_keys(seed, rounds)
    x = i
    while True:
        left, right = (x >> w) & mask, x & mask
        for k1, k2 in zip(keys[::2], keys[1::2]):
            left ^= f(right) ^ (k1 & mask)
            right ^= f(left) ^ (k2 & mask)
        x = (left << w) | right
        if x < n:
            return x
