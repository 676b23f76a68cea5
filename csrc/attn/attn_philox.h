/*
 * attn_philox.h - the random bits of attention dropout, shared by the CPU
 * reference and the CUDA kernels so both draw the SAME mask: the mask is
 * never stored, every kernel regenerates it from (seed, offset) and the
 * coordinates of an element.
 *
 * Generator: Philox4x32-10 (csrc/core/philox.h, shared with act's dropout):
 * a counter-based generator, so any element's bits are computed directly
 * from its coordinates, in any order, on any backend.
 *
 * Which bits an element takes.  Element (b, h, r, c) of the probabilities
 * (sequence b, query head h, query row r and key c within the sequence)
 * belongs to the group of 8 elements
 *     rows r0 + {0, 8}  x  keys k0 + {0, 8, 16, 24},
 *     r0 = 16 * (r / 16) + r % 8,   k0 = 32 * (c / 32) + c % 8,
 * which one Philox call serves:
 *     counter = (x0, x1, x2, x3) with x0 = (c / 32) * 8 + c % 8,
 *               x1 = (r / 16) * 8 + r % 8,
 *               x2 + 2^32 x3 = offset + b * heads + h   (64-bit sum),
 *     key     = (seed low 32 bits, seed high 32 bits).
 * Output word j = (c % 32) / 8 holds row r0 in its low 16 bits and row r0 + 8
 * in its high 16 bits.  The element is kept iff that 16-bit value u16
 * satisfies u16 >= threshold = ceil(p * 65536), i.e. u >= p for the uniform
 * u = u16 / 65536, so P(keep) = 1 - p up to 2^-16; kept probabilities are
 * scaled by 1 / (1 - p).
 * Why this grouping: a thread of the mma.sync kernels holds rows g, g + 8 of
 * each 16-row tile and, per 16x8 score tile, two neighbouring keys; the
 * backward's transposed tiles hold keys g, g + 8 and neighbouring queries.
 * Both hold whole groups (keys k0 .. k0 + 24 of a 32-key block: all of a
 * forward tile's keys are in one thread; a backward warp owns 32 keys at head
 * dims up to 64), so each thread makes one call per 8 of its elements.
 * Each (b, h) uses one counter value in (x2, x3): a call consumes
 * batch * heads of the offset space, which is what ops/attn.py advances
 * torch's generator offset by.
 */
#ifndef SF_ATTN_PHILOX_H
#define SF_ATTN_PHILOX_H

#include <stdint.h>

#include "../core/philox.h"

/* The 8 elements' bits of the group at query group rg = (r/16)*8 + r%8 and
 * key group cg = (c/32)*8 + c%8 of stream bh = b * heads + h. */
SF_HD sf_philox4 sf_attn_drop_bits(uint32_t seed_lo, uint32_t seed_hi, uint64_t offset, int64_t bh,
                                   uint32_t rg, uint32_t cg)
{
    const uint64_t s = offset + (uint64_t)bh;
    return sf_philox4x32(cg, rg, (uint32_t)s, (uint32_t)(s >> 32), seed_lo, seed_hi);
}

/* The 16-bit uniform of element (r, c) among its group's bits. */
SF_HD uint32_t sf_attn_drop_u16(sf_philox4 bits, int r, int c)
{
    return (bits.v[(c & 31) >> 3] >> ((r & 8) ? 16 : 0)) & 0xffffu;
}

/* 1 when element (b, h, r, c) is kept (threshold = ceil(p * 65536)). */
SF_HD int sf_attn_drop_keep(uint32_t seed_lo, uint32_t seed_hi, uint64_t offset, int64_t bh,
                            uint32_t threshold, int r, int c)
{
    sf_philox4 bits = sf_attn_drop_bits(seed_lo, seed_hi, offset, bh, (uint32_t)((r >> 4) * 8 + (r & 7)),
                                        (uint32_t)((c >> 5) * 8 + (c & 7)));
    return sf_attn_drop_u16(bits, r, c) >= threshold;
}

#endif /* SF_ATTN_PHILOX_H */
