"""The attention dropout mask written again in numpy from its specification
(csrc/attn/attn_philox.h), for the tests: Philox4x32-10 (Salmon et al.,
SC'11) and the rule that maps element (sequence b, head h, query r, key c)
to its 16 random bits.

    counter = ((c // 32) * 8 + c % 8,  (r // 16) * 8 + r % 8,
               low and high 32 bits of offset + b * heads + h),
    key = (seed & 0xffffffff, seed >> 32),
    u16 = word[(c % 32) // 8] >> (16 if r % 16 >= 8 else 0) & 0xffff,
    keep = u16 >= ceil(p * 65536).
"""
import math

import numpy as np
import torch

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_MASK32 = np.uint64(0xFFFFFFFF)


def philox4x32_10(x0, x1, x2, x3, k0, k1):
    """Vectorized Philox4x32-10: counters are uint32-valued arrays (any
    broadcastable shapes), the key two python ints; returns 4 uint64 arrays
    holding the 32-bit output words."""
    x0, x1, x2, x3 = (np.asarray(x, dtype=np.uint64) & _MASK32 for x in (x0, x1, x2, x3))
    x0, x1, x2, x3 = np.broadcast_arrays(x0, x1, x2, x3)
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    for _ in range(10):
        p0 = _M0 * x0
        p1 = _M1 * x2
        y0 = (p1 >> np.uint64(32)) ^ x1 ^ np.uint64(k0)
        y2 = (p0 >> np.uint64(32)) ^ x3 ^ np.uint64(k1)
        x1 = p1 & _MASK32
        x3 = p0 & _MASK32
        x0, x2 = y0, y2
        k0 = (k0 + _W0) & 0xFFFFFFFF
        k1 = (k1 + _W1) & 0xFFFFFFFF
    return x0, x1, x2, x3


def threshold(p):
    return math.ceil(float(p) * 65536.0)


def keep_mask(seed, offset, b, heads, sq, sk, p):
    """bool [heads, sq, sk]: which probabilities of sequence b survive."""
    r = np.arange(sq, dtype=np.int64)[:, None]
    c = np.arange(sk, dtype=np.int64)[None, :]
    rg = (r // 16) * 8 + r % 8
    cg = (c // 32) * 8 + c % 8
    j = (c % 32) // 8
    shift = np.where((r % 16) >= 8, 16, 0).astype(np.uint64)
    thr = threshold(p)
    out = np.empty((heads, sq, sk), dtype=bool)
    for h in range(heads):
        s = (int(offset) + b * heads + h) % 2**64
        words = np.stack(philox4x32_10(cg, rg, s & 0xFFFFFFFF, s >> 32, seed & 0xFFFFFFFF, seed >> 32))
        word = np.take_along_axis(words, np.broadcast_to(j, (sq, sk))[None].astype(np.int64), axis=0)[0]
        u16 = (word >> shift) & np.uint64(0xFFFF)
        out[h] = u16 >= thr
    return torch.from_numpy(out)


def drop_multiplier(seed, offset, b, heads, sq, sk, p, dtype=torch.float64):
    """keep / (1 - p) as [heads, sq, sk] (the factor P is multiplied by)."""
    return keep_mask(seed, offset, b, heads, sq, sk, p).to(dtype) / (1.0 - p)
