/*
 * launch_cache.cuh - a small table of facts about kernel launches that the
 * CUDA runtime is asked once and that every later launch reads (blocks per SM
 * at a block size, the dynamic shared memory a kernel was opted in to).
 *
 * Launches come from any host thread (DataLoader workers, several streams,
 * torch's autograd threads), so the table is safe to share: an entry's key is
 * written once, under the table's lock, before a release store of the count
 * publishes it; readers take no lock (an acquire load of the count, then
 * plain reads of published keys and relaxed loads of the atomic values).  A
 * value may later be raised, under the lock, never torn.  A full table only
 * means asking the runtime again.
 *
 * Key: a plain struct with operator==.  Only CUDA translation units (C++)
 * include this header.
 */
#ifndef SF_LAUNCH_CACHE_CUH
#define SF_LAUNCH_CACHE_CUH

#include <atomic>
#include <mutex>
#include <stdint.h>

#include "cuda_util.h"

template <typename Key, int N>
class sf_launch_cache {
public:
    /* The value stored for key, if any (lock-free). */
    bool find(const Key &key, int64_t *value) const
    {
        const int n = used_.load(std::memory_order_acquire);
        for (int i = 0; i < n; ++i)
            if (keys_[i] == key) {
                *value = values_[i].load(std::memory_order_relaxed);
                return true;
            }
        return false;
    }

    /* Writers hold this while they ask the runtime and store the answer, so
     * two threads missing at once ask in turn, the second seeing the first's
     * answer when it looks again. */
    std::mutex &lock() { return lock_; }

    /* Store key's value, adding the key if there is room.  Hold lock(). */
    void put(const Key &key, int64_t value)
    {
        const int n = used_.load(std::memory_order_relaxed);
        for (int i = 0; i < n; ++i)
            if (keys_[i] == key) {
                values_[i].store(value, std::memory_order_relaxed);
                return;
            }
        if (n == N)
            return;
        keys_[n] = key;
        values_[n].store(value, std::memory_order_relaxed);
        used_.store(n + 1, std::memory_order_release);
    }

private:
    Key keys_[N] = {};
    std::atomic<int64_t> values_[N] = {};
    std::atomic<int> used_{0};
    std::mutex lock_;
};

/* Dynamic shared memory beyond the default 48 KB needs the opt-in attribute,
 * and the limit counts the kernel's static shared memory too.  static_bound:
 * what the caller knows the kernel's static shared memory to be at most; a
 * request that fits 48 KB with it returns at once, others ask the kernel's
 * static size.  The attribute stays set, so the query and the set run once
 * per kernel, device and larger request, not on every call (host time per
 * launch).  Under the cache's lock the opt-in only grows: a thread asking
 * for less than another already set finds it done and leaves it.  Launches
 * inside a CUDA graph capture then make no runtime call. */
struct sf_smem_key {
    const void *kernel;
    int device;
    bool operator==(const sf_smem_key &o) const { return kernel == o.kernel && device == o.device; }
};

template <typename K>
sf_status sf_allow_smem(const char *op, K kernel, size_t bytes, size_t static_bound, int device)
{
    constexpr size_t kDefault = 48 * 1024;
    if (bytes + static_bound <= kDefault)
        return SF_OK;
    static sf_launch_cache<sf_smem_key, 64> cache;
    const sf_smem_key key = {(const void *)kernel, device};
    int64_t allowed;
    if (cache.find(key, &allowed) && allowed >= (int64_t)bytes)
        return SF_OK;
    std::lock_guard<std::mutex> hold(cache.lock());
    if (cache.find(key, &allowed) && allowed >= (int64_t)bytes)
        return SF_OK;
    cudaFuncAttributes attr;
    SF_CUDA_TRY(op, cudaFuncGetAttributes(&attr, (const void *)kernel));
    if (bytes + attr.sharedSizeBytes > kDefault)
        SF_CUDA_TRY(op, cudaFuncSetAttribute((const void *)kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             (int)bytes));
    cache.put(key, (int64_t)bytes);
    return SF_OK;
}

#endif /* SF_LAUNCH_CACHE_CUH */
