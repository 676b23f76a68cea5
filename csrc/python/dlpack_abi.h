/*
 * dlpack_abi.h - the parts of the DLPack ABI (version 1.x) seqfuse consumes:
 * the tensor structs, the managed (legacy and versioned) wrappers, and the
 * C exchange API table that a framework may publish on its tensor type as
 * `__dlpack_c_exchange_api__`.
 *
 * Written from the DLPack specification; field order and enum values are the
 * ABI and must not change.
 */
#ifndef SF_DLPACK_ABI_H
#define SF_DLPACK_ABI_H

#include <stdint.h>

#define SF_DLPACK_MAJOR 1

typedef struct {
    uint32_t major;
    uint32_t minor;
} DLPackVersion;

typedef enum {
    kDLCPU = 1,
    kDLCUDA = 2,
    kDLCUDAHost = 3,
    kDLCUDAManaged = 13,
} DLDeviceType;

typedef struct {
    int32_t device_type; /* a DLDeviceType; int32 is its ABI width */
    int32_t device_id;
} DLDevice;

enum {
    kDLInt = 0,
    kDLUInt = 1,
    kDLFloat = 2,
    kDLBfloat = 4,
    kDLBool = 6,
    kDLFloat8_e4m3fn = 10,
    kDLFloat8_e5m2 = 12,
    kDLFloat8_e8m0fnu = 14,
    kDLFloat4_e2m1fn = 17,
};

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;

typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides; /* may be NULL (contiguous) before DLPack 1.2 */
    uint64_t byte_offset;
} DLTensor;

typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

#define SF_DLPACK_FLAG_READ_ONLY (1ULL << 0)

typedef struct DLManagedTensorVersioned {
    DLPackVersion version;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensorVersioned *self);
    uint64_t flags;
    DLTensor dl_tensor;
} DLManagedTensorVersioned;

/* The C exchange API (DLPack 1.2+).  seqfuse uses the two non-owning entries:
 * a DLTensor filled in place (no allocation, no capsule) and the producer's
 * current work stream. */
typedef struct DLPackExchangeAPIHeader {
    DLPackVersion version;
    struct DLPackExchangeAPIHeader *prev_api;
} DLPackExchangeAPIHeader;

typedef struct DLPackExchangeAPI {
    DLPackExchangeAPIHeader header;
    int (*managed_tensor_allocator)(DLTensor *prototype, DLManagedTensorVersioned **out,
                                    void *error_ctx,
                                    void (*set_error)(void *, const char *, const char *));
    int (*managed_tensor_from_py_object_no_sync)(void *py_object,
                                                 DLManagedTensorVersioned **out);
    int (*managed_tensor_to_py_object_no_sync)(DLManagedTensorVersioned *tensor,
                                               void **out_py_object);
    int (*dltensor_from_py_object_no_sync)(void *py_object, DLTensor *out);
    int (*current_work_stream)(int32_t device_type, int32_t device_id, void **out_stream);
} DLPackExchangeAPI;

#endif /* SF_DLPACK_ABI_H */
