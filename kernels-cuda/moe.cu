// DeepSeek-V4's routed experts without leaving the device (after deepseek_v4.cu and
// mma_tile.cu): `dsv4_moe_align` groups the step's (token, slot) pairs by expert into
// tiles of BM rows (vLLM's moe_align_block_size), and `dsv4_moe_{up,down}_*` run each tile
// against its expert's weights (`tile_gemm`). The grid is sized for the most tiles a step
// can have, so no count ever goes back to the host; tiles past the step's own return at
// once.
//
// A pair's output row is the pair's index (token · k + slot), so the order rows take inside
// a tile — set by atomics — reaches no result: an output row is one row's dot products,
// whatever rows share its tile.
#define MOE_MAX_EXPERTS 1024

// Whether this rank computes expert `e` for `token`: `owners` is null (every pair), or per
// expert its replica count then `replicas` ranks (expert_parallel.rs's owner table).
__device__ __forceinline__ bool moe_owns(const u32* owners, int replicas, int rank, int e,
                                         int token) {
    if (owners == nullptr) return true;
    const u32* o = owners + (long long)e * (1 + replicas);
    return (int)o[1 + token % o[0]] == rank;
}

// One block of 1024 threads (num_experts ≤ 1024). Adds every pair to `counts` (the load EPLB reads), lays the
// pairs this rank computes out by expert in tiles of `bm` (`sorted`, −1 past an expert's
// last pair), `tile_expert` per tile, and the tile count in `num_tiles`.
extern "C" __global__ void dsv4_moe_align_kernel(const u32* chosen, int pairs, int k,
                                                 int num_experts, const u32* owners,
                                                 int replicas, int rank, u32* counts, int bm,
                                                 int* tile_expert, int* sorted,
                                                 int* num_tiles) {
    __shared__ int routed[MOE_MAX_EXPERTS], owned[MOE_MAX_EXPERTS], start[MOE_MAX_EXPERTS];
    __shared__ int total;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) routed[e] = owned[e] = 0;
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        int e = chosen[i];
        atomicAdd(&routed[e], 1);
        if (moe_owns(owners, replicas, rank, e, i / k)) atomicAdd(&owned[e], 1);
    }
    __syncthreads();
    {
        // Each expert's first tile: an exclusive scan of the tile counts (a thread an
        // expert, num_experts ≤ blockDim.x), by warps, then over the warps' totals.
        __shared__ int warp_total[32];
        int e = threadIdx.x, lane = e & 31, w = e >> 5;
        int n = e < num_experts ? (owned[e] + bm - 1) / bm : 0, incl = n;
        for (int o = 1; o < 32; o <<= 1) {
            int v = __shfl_up_sync(0xffffffffu, incl, o);
            if (lane >= o) incl += v;
        }
        if (lane == 31) warp_total[w] = incl;
        __syncthreads();
        if (w == 0) {
            int v = lane < (int)(blockDim.x >> 5) ? warp_total[lane] : 0;
            for (int o = 1; o < 32; o <<= 1) {
                int u = __shfl_up_sync(0xffffffffu, v, o);
                if (lane >= o) v += u;
            }
            warp_total[lane] = v;
        }
        __syncthreads();
        incl += w > 0 ? warp_total[w - 1] : 0;
        if (e < num_experts) start[e] = incl - n;
        if (e == num_experts - 1) {
            total = incl;
            *num_tiles = incl;
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
        counts[e] += routed[e];
        int n = (owned[e] + bm - 1) / bm;
        for (int j = 0; j < n; ++j) tile_expert[start[e] + j] = e;
        owned[e] = 0;  // from here on, the expert's next free row
    }
    for (int i = threadIdx.x; i < total * bm; i += blockDim.x) sorted[i] = -1;
    __syncthreads();
    for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
        int e = chosen[i];
        if (!moe_owns(owners, replicas, rank, e, i / k)) continue;
        sorted[start[e] * bm + atomicAdd(&owned[e], 1)] = i;
    }
}

// Entry points: up (gate and up, SwiGLU) and down, per weight format, for few rows a tile
// (`few`: 16 rows, K split four ways) or many (`many`: 64 rows, 128 features), and with
// f32-accurate activations (`exact`, HILO) or bf16 ones.
#define MOE_ENTRY(name, MT, NT, KSPLIT, FMT, SWIGLU, HILO)                                        \
    extern "C" __global__ void __launch_bounds__(128) name(                                      \
        float* out, const float* x, int x_div, const int* sorted, const int* tile_expert,        \
        const int* num_tiles, const u64* w1, const u64* w2, int N, int K, float limit) {          \
        tile_gemm<MT, NT, KSPLIT, FMT, SWIGLU, HILO>(out, x, x_div, sorted, tile_expert,          \
                                                     num_tiles, w1, w2, 0, N, K, limit);              \
    }
#define MOE_ENTRIES(fmt_name, FMT)                                                               \
    MOE_ENTRY(dsv4_moe_up_##fmt_name##_few_kernel, 1, 2, 4, FMT, true, true)                     \
    MOE_ENTRY(dsv4_moe_down_##fmt_name##_few_kernel, 1, 2, 4, FMT, false, true)                  \
    MOE_ENTRY(dsv4_moe_up_##fmt_name##_many_kernel, 4, 4, 1, FMT, true, false)                   \
    MOE_ENTRY(dsv4_moe_down_##fmt_name##_many_kernel, 4, 4, 1, FMT, false, false)
MOE_ENTRIES(bf16, TILE_BF16)
MOE_ENTRIES(mxfp4, TILE_MXFP4)

// out[t] += Σ weight[t, j] · ys[t·k + j] over the token's k slots taken in increasing
// expert id (the order the CPU reference adds them in).
extern "C" __global__ void dsv4_moe_combine_kernel(float* out, const float* ys, const u32* chosen,
                                                   const float* weight, int k, int hidden) {
    __shared__ int order[32];
    // Blocks split the token's channels (grid.y is the token); each sorts its slots.
    int t = blockIdx.y;
    if (threadIdx.x == 0) {
        // k ≤ 32 (dsv4_prepare): an insertion sort of the slots by expert.
        for (int j = 0; j < k; ++j) {
            int i = j;
            while (i > 0 && chosen[(long long)t * k + order[i - 1]] > chosen[(long long)t * k + j]) {
                order[i] = order[i - 1];
                --i;
            }
            order[i] = j;
        }
    }
    __syncthreads();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= hidden) return;
    float o = out[(long long)t * hidden + c];
    for (int j = 0; j < k; ++j) {
        int slot = order[j];
        o += weight[t * k + slot] * ys[((long long)t * k + slot) * hidden + c];
    }
    out[(long long)t * hidden + c] = o;
}
