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

// Decode-sized steps (default mode, no expert-parallel group, MXFP4 experts): each pair's
// rows as dot products on the CUDA cores, its expert's weights streamed once for the pair,
// with no barrier between loads and products. A lane takes a run of 16 blocks (272 bytes:
// 17 aligned 16-byte loads, all in flight at once, covering 512 values); the K / 512 lanes
// of a row add their runs by shuffles, in lane order. The pair's input row is in shared
// memory as f32, each run of 512 values 4 floats (a float4's 4 banks) past the last: the
// lanes of a quarter-warp read the same column of different runs, and unpadded those are
// one bank (an 8-way conflict on every load: 114 µs for V4-Flash's up pass).
// Block: 8 warps of 32 / runs rows each (gate and up rows alternate when SWIGLU); grid:
// (feature blocks, pairs). The up pass also adds each pair to `counts`.
#define MOE_GEMV_MAX_K 8192
#define MOE_GEMV_RUN 512
#define MOE_GEMV_PAD 4

// Four bytes of `w` from byte `at` (a constant once unrolled: a funnel shift).
__device__ __forceinline__ u32 moe_bytes_at(const u32* w, int at) {
    return __funnelshift_r(w[at / 4], w[at / 4 + 1], 8 * (at % 4));
}

// A 16-byte load the compiler keeps where it is written: the run's 17 loads all go out
// before the first product (left to itself, it issued each next to its use, 48 registers
// and a load or two in flight a lane: 0.45 TB/s).
__device__ __forceinline__ uint4 moe_ld16(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

template <bool SWIGLU>
__device__ void moe_gemv_mxfp4(float* out, const float* x, int x_div, const u32* chosen,
                               const u64* w1, const u64* w2, u32* counts, int N, int K,
                               float limit) {
    __shared__ __align__(16) float xs[MOE_GEMV_MAX_K + MOE_GEMV_MAX_K / MOE_GEMV_RUN * MOE_GEMV_PAD];
    int p = blockIdx.y;
    int e = chosen[p];
    if (counts != nullptr && blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(&counts[e], 1u);
    const float* xr = x + (long long)(p / x_div) * K;
    for (int i = threadIdx.x * 4; i < K; i += blockDim.x * 4)
        *(float4*)&xs[i + i / MOE_GEMV_RUN * MOE_GEMV_PAD] = *(const float4*)&xr[i];
    __syncthreads();
    int runs = K / MOE_GEMV_RUN, rpw = 32 / runs;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int r = lane / runs, s = lane % runs;
    int fpw = SWIGLU ? rpw / 2 : rpw, used = SWIGLU ? 2 * fpw : rpw;
    int f = (blockIdx.x * 8 + warp) * fpw + (SWIGLU ? r / 2 : r);
    int mat = SWIGLU ? r % 2 : 0;
    float acc = 0.0f;
    if (r < used && f < N) {
        const u8* row = (const u8*)(mat ? w2[e] : w1[e]) + (long long)f * (K / 32) * 17;
        const uint4* run = (const uint4*)(row + (long long)s * 272);
        u32 w[69];
#pragma unroll
        for (int i = 0; i < 17; ++i) {
            uint4 v = moe_ld16(run + i);
            w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
        }
        w[68] = 0;
        // All 17 loads land before any product: ptxas otherwise sinks each load to its use.
        u32 all = 0;
#pragma unroll
        for (int i = 0; i < 68; ++i) all ^= w[i];
        if (all == 0x9e3779b9u && N < 0) acc = 1.0f;  // never: N > 0
        const float* xk = xs + s * (MOE_GEMV_RUN + MOE_GEMV_PAD);
#pragma unroll
        for (int b = 0; b < 16; ++b) {
            u32 ex = moe_bytes_at(w, 17 * b) & 0xffu;
            u32 s2 = ex != 0 ? ex << 7 : 0x40u;  // 2^(e−127) as bf16 (tile_load_b's)
            s2 |= s2 << 16;
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < 4; ++i) {
                u32 codes = moe_bytes_at(w, 17 * b + 1 + 4 * i);
                float4 xa = *(const float4*)&xk[32 * b + 8 * i];
                float4 xb = *(const float4*)&xk[32 * b + 8 * i + 4];
                u32 w01, w23, w45, w67;
                tile_e2m1x4(codes & 0xffffu, s2, w01, w23);
                tile_e2m1x4(codes >> 16, s2, w45, w67);
                part = fmaf(tile_bf16_lo(w01), xa.x, part);
                part = fmaf(tile_bf16_hi(w01), xa.y, part);
                part = fmaf(tile_bf16_lo(w23), xa.z, part);
                part = fmaf(tile_bf16_hi(w23), xa.w, part);
                part = fmaf(tile_bf16_lo(w45), xb.x, part);
                part = fmaf(tile_bf16_hi(w45), xb.y, part);
                part = fmaf(tile_bf16_lo(w67), xb.z, part);
                part = fmaf(tile_bf16_hi(w67), xb.w, part);
            }
            acc += part;
        }
    }
    float total = acc;
    for (int j = 1; j < runs; ++j) total += __shfl_sync(0xffffffffu, acc, (lane + j) & 31);
    float up = SWIGLU ? __shfl_sync(0xffffffffu, total, (lane + runs) & 31) : 0.0f;
    if (r >= used || f >= N || s != 0 || mat != 0) return;
    if (SWIGLU) {
        float g = fminf(total, limit);
        float u = fminf(fmaxf(up, -limit), limit);
        total = g * (1.0f / (1.0f + expf(-g))) * u;
    }
    out[(long long)p * N + f] = total;
}

extern "C" __global__ void __launch_bounds__(256)
    dsv4_moe_gemv_up_mxfp4_kernel(float* out, const float* x, int x_div, const u32* chosen,
                                  const u64* w1, const u64* w2, u32* counts, int N, int K,
                                  float limit) {
    moe_gemv_mxfp4<true>(out, x, x_div, chosen, w1, w2, counts, N, K, limit);
}

extern "C" __global__ void __launch_bounds__(256)
    dsv4_moe_gemv_down_mxfp4_kernel(float* out, const float* x, int x_div, const u32* chosen,
                                    const u64* w1, const u64* w2, u32* counts, int N, int K,
                                    float limit) {
    moe_gemv_mxfp4<false>(out, x, x_div, chosen, w1, w2, counts, N, K, limit);
}

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
