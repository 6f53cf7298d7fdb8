// A step's host calls (src/kernels/cuda/host_calls.rs) as flags in page-locked host
// memory that the device reads and writes through the unified address space: the thread
// that launched the step polls them, so no host function and no thread wake-up sits
// between the device and the host's part of a layer. One thread each; system-scope
// acquire loads and release stores, so neither side reads a stale word.

__device__ __forceinline__ unsigned int host_flag_load(const unsigned int* p) {
    unsigned int v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void host_flag_store(unsigned int* p, unsigned int v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" : : "l"(p), "r"(v) : "memory");
}

__device__ __forceinline__ unsigned long long host_flag_now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Raises `*flag` to `value` once everything before it on the stream (the copies of the
// call's inputs to the host) is done.
extern "C" __global__ void host_flag_raise_kernel(unsigned int* flag, unsigned int value) {
    __threadfence_system();
    host_flag_store(flag, value);
}

// Waits until the host sets `*flag` to `value` (or to all ones: the host gave up on the
// step) and lowers it for the next call. After `limit_ns` it gives up instead and says
// so in `report` ([value, seen]), which the host reads back: a fault ends a step, it
// never holds the stream.
extern "C" __global__ void host_flag_wait_kernel(unsigned int* flag, unsigned int value,
                                                 unsigned int* report,
                                                 unsigned long long limit_ns) {
    const unsigned long long start = host_flag_now_ns();
    unsigned int seen;
    while ((seen = host_flag_load(flag)) != value && seen != 0xffffffffu) {
        if (host_flag_now_ns() - start > limit_ns) {
            report[1] = seen;
            host_flag_store(report, value);
            return;
        }
        __nanosleep(256);
    }
    if (seen == value) {
        host_flag_store(flag, 0u);
    }
}
