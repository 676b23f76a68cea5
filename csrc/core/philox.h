/*
 * philox.h - Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy
 * as 1, 2, 3", SC'11), the counter-based generator behind every dropout in
 * seqfuse (act's bias_dropout_add, attention dropout): any element's random
 * bits are a pure function of (key, counter), so a backward regenerates its
 * forward's mask instead of storing it, and the CPU reference and the CUDA
 * kernels draw the same bits.  Static inline, usable from host C and device
 * code.  Checked against Random123's known answers (check_act.cu,
 * tests/test_attn.py).
 */
#ifndef SF_CORE_PHILOX_H
#define SF_CORE_PHILOX_H

#include <stdint.h>

#include "float_bits.h" /* SF_HD: static inline, __host__ __device__ under nvcc */

typedef struct {
    uint32_t v[4];
} sf_philox4;

SF_HD uint32_t sf_mulhi32(uint32_t a, uint32_t b)
{
    return (uint32_t)(((uint64_t)a * (uint64_t)b) >> 32);
}

/* Four random words for the 128-bit counter (c0, c1, c2, c3) under the key (k0, k1). */
SF_HD sf_philox4 sf_philox4x32(uint32_t c0, uint32_t c1, uint32_t c2, uint32_t c3, uint32_t k0,
                                      uint32_t k1)
{
    for (int r = 0; r < 10; ++r) {
        uint32_t hi0 = sf_mulhi32(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
        uint32_t hi1 = sf_mulhi32(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
        uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
        k0 += 0x9E3779B9u;
        k1 += 0xBB67AE85u;
    }
    sf_philox4 out = {{c0, c1, c2, c3}};
    return out;
}

/* A 64-bit counter (the upper two counter words 0) under a 64-bit key. */
SF_HD sf_philox4 sf_philox(uint64_t key, uint64_t counter)
{
    return sf_philox4x32((uint32_t)counter, (uint32_t)(counter >> 32), 0u, 0u, (uint32_t)key,
                         (uint32_t)(key >> 32));
}

#endif /* SF_CORE_PHILOX_H */
