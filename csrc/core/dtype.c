/*
 * dtype.c - the dtype table: storage size, name and kind of each sf_dtype.
 *
 * Names follow torch (float8_e4m3fn, float8_e5m2, float8_e8m0fnu) so error
 * messages read the way a PyTorch user writes the dtype.
 */
#include "seqfuse.h"

typedef struct {
    const char *name;
    size_t size;
    int is_float;
} sf_dtype_info;

static const sf_dtype_info sf_dtype_table[SF_NUM_DTYPES] = {
    [SF_FLOAT32] = {"float32", 4, 1},
    [SF_FLOAT16] = {"float16", 2, 1},
    [SF_BFLOAT16] = {"bfloat16", 2, 1},
    [SF_FLOAT8_E4M3] = {"float8_e4m3fn", 1, 1},
    [SF_FLOAT8_E5M2] = {"float8_e5m2", 1, 1},
    [SF_FLOAT8_E8M0] = {"float8_e8m0fnu", 1, 1},
    [SF_FLOAT4_E2M1X2] = {"float4_e2m1fn_x2", 1, 1},
    [SF_INT32] = {"int32", 4, 0},
    [SF_INT64] = {"int64", 8, 0},
    [SF_UINT8] = {"uint8", 1, 0},
    [SF_BOOL] = {"bool", 1, 0},
};

static int sf_dtype_valid(sf_dtype dtype)
{
    return (int)dtype >= 0 && dtype < SF_NUM_DTYPES;
}

size_t sf_dtype_size(sf_dtype dtype)
{
    return sf_dtype_valid(dtype) ? sf_dtype_table[dtype].size : 0;
}

const char *sf_dtype_name(sf_dtype dtype)
{
    return sf_dtype_valid(dtype) ? sf_dtype_table[dtype].name : "<invalid dtype>";
}

int sf_dtype_is_float(sf_dtype dtype)
{
    return sf_dtype_valid(dtype) ? sf_dtype_table[dtype].is_float : 0;
}
