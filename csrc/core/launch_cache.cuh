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

#endif /* SF_LAUNCH_CACHE_CUH */
