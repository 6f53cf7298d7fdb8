// The batch-invariant GEMM on the tensor cores (after llama.cu and mma_tile.cu): C[m, n] =
// Σ_k X[m, k] · W[n, k], X f32, W bf16, C f32, K a multiple of 8. The weights are the
// mma's A operand (16 features a warp) and the rows its B (8 a tile, up to NT tiles a
// block), so a decode batch streams the weights straight from global memory into
// fragments — no shared staging, no barrier inside the loop — with 4 32-column
// chunks of loads in flight per warp. A block's 8 warps split K by chunks (warp w takes
// chunks w, w + 8, …, each in order) and their sums are added in warp order: a row's
// arithmetic is the same whatever M is, which tile it lands in and in which of a tile's
// columns (an mma's output column depends on its own column of B only). Activations are
// f32-accurate: bf16 plus its bf16 remainder, two mmas (SGLang's fixed split, with the
// bf16 weights exact in the mma). Grid: (16·FG-feature blocks, NT·8-row groups); 256 threads.
// FP8 weights (e4m3 with f32 block scales) are read as they are stored and made bf16 in
// registers exactly as `dequant_bf16_kernel` makes them, so a row's sums equal those of the
// dequantized copy — without writing and re-reading that copy each GEMM (5 bytes a weight
// where the packed bytes are 1).
#define INV_WARPS 8

// 16 bytes of weights, issued where written: ptxas otherwise sinks each load to its first
// use, leaving one chunk in flight.
__device__ __forceinline__ uint4 inv_load16(const bf16_t* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

// FG 16-feature groups a warp (each with the 8-warp split above, so a feature's sums are
// the same whichever FG): a wider batch reads its activations once for FG groups, where a
// 16-feature block re-read them N/16 times (at M = 64, 8× the weights' bytes). U chunks of
// loads in flight; U · FG = 4 keeps the weights' registers and bytes in flight the same.
__device__ __forceinline__ uint2 inv_load8(const u8* p) {
    uint2 v;
    asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
    return v;
}

// Where the weights are and how a lane's 8 columns become bf16x2 words.
struct InvBf16 {
    static constexpr bool FP8 = false;
    const bf16_t* w;
};
struct InvFp8 {
    static constexpr bool FP8 = true;
    const u8* w;
    const float* scales;
    int block_rows, block_cols;
};

// Eight e4m3 bytes times their block's scale as four bf16x2 words (dequant_bf16_kernel's
// rounding: f32 product, then nearest-even bf16).
__device__ __forceinline__ uint4 inv_fp8_words(uint2 b, float s) {
    u32 o[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        u32 word = i < 2 ? b.x : b.y;
        float2 v = e4m3x2_to_f32((unsigned short)(word >> (16 * (i & 1))));
        o[i] = tile_bf16x2(v.x * s, v.y * s);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// KS splits of K (blockIdx.z): split s's warp w takes chunks 8s + w, 8s + w + 8·KS, …, and
// writes its sums to C + s·M·ldc, for `matmul_invariant_splits_kernel` to add in split
// order. KS comes from the matrix's shape alone, so a row's sums still do not depend on
// the batch; it puts a narrow matrix (mHC's 24 features over 16 384 columns: 2 blocks)
// on enough SMs.
template <int NT, int FG, int U, typename WT>
__device__ void invariant_mv(float* C, int ldc, const float* X, WT W, int M, int N, int K, int KS,
                             int row_block) {
    constexpr bool FP8 = WT::FP8;
    __shared__ float red[INV_WARPS][16][NT * 8];
    int split = blockIdx.z;
    C += (long long)split * M * ldc;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, tq = lane & 3;
    int nb = blockIdx.x * 16 * FG, m0 = row_block * NT * 8;
    // Features past N read row 0 (valid); their sums are not stored.
    long long f0[FG], f1[FG];
#pragma unroll
    for (int j = 0; j < FG; ++j) {
        f0[j] = nb + 16 * j + g < N ? nb + 16 * j + g : 0;
        f1[j] = nb + 16 * j + g + 8 < N ? nb + 16 * j + g + 8 : 0;
    }
    const float* xr[NT];
    bool live[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        int r = m0 + 8 * t + g;
        live[t] = r < M;
        xr[t] = X + (long long)(live[t] ? r : 0) * K + 8 * tq;
    }
    float acc[FG][NT][4];
#pragma unroll
    for (int j = 0; j < FG; ++j)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[j][t][0] = acc[j][t][1] = acc[j][t][2] = acc[j][t][3] = 0.0f;
    int chunks = (K + 31) / 32;
    for (int c0 = INV_WARPS * split + warp; c0 < chunks; c0 += INV_WARPS * KS * U) {
        uint4 a[U][FG][2];
        uint2 b[FP8 ? U : 1][FG][2];
        float sc[FP8 ? U : 1][FG][2];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int k = (c0 + u * INV_WARPS * KS) * 32 + 8 * tq;
            bool in = c0 + u * INV_WARPS * KS < chunks && k < K;
#pragma unroll
            for (int j = 0; j < FG; ++j) {
                if constexpr (FP8) {
                    const InvFp8& w = W;
                    int grid_cols = (K + w.block_cols - 1) / w.block_cols;
                    b[u][j][0] = in ? inv_load8(w.w + f0[j] * K + k) : make_uint2(0, 0);
                    b[u][j][1] = in ? inv_load8(w.w + f1[j] * K + k) : make_uint2(0, 0);
                    int kc = (in ? k : 0) / w.block_cols;
                    sc[u][j][0] = w.scales[(f0[j] / w.block_rows) * grid_cols + kc];
                    sc[u][j][1] = w.scales[(f1[j] / w.block_rows) * grid_cols + kc];
                } else {
                    a[u][j][0] = in ? inv_load16(W.w + f0[j] * K + k) : make_uint4(0, 0, 0, 0);
                    a[u][j][1] = in ? inv_load16(W.w + f1[j] * K + k) : make_uint4(0, 0, 0, 0);
                }
            }
        }
        if constexpr (FP8) {
#pragma unroll
            for (int u = 0; u < U; ++u)
#pragma unroll
                for (int j = 0; j < FG; ++j) {
                    a[u][j][0] = inv_fp8_words(b[u][j][0], sc[u][j][0]);
                    a[u][j][1] = inv_fp8_words(b[u][j][1], sc[u][j][1]);
                }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            int k = (c0 + u * INV_WARPS * KS) * 32;
            bool in = c0 + u * INV_WARPS * KS < chunks && k + 8 * tq < K;
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                float4 p = make_float4(0.f, 0.f, 0.f, 0.f), q = p;
                if (in && live[t]) {
                    p = *(const float4*)(xr[t] + k);
                    q = *(const float4*)(xr[t] + k + 4);
                }
                // Columns 8tq + 0..3 are the first k16 step's, 8tq + 4..7 the second's,
                // for the weights and the rows alike.
                u32 h0 = tile_bf16x2(p.x, p.y), h1 = tile_bf16x2(p.z, p.w);
                u32 h2 = tile_bf16x2(q.x, q.y), h3 = tile_bf16x2(q.z, q.w);
                u32 l0 = tile_bf16x2(p.x - tile_bf16_lo(h0), p.y - tile_bf16_hi(h0));
                u32 l1 = tile_bf16x2(p.z - tile_bf16_lo(h1), p.w - tile_bf16_hi(h1));
                u32 l2 = tile_bf16x2(q.x - tile_bf16_lo(h2), q.y - tile_bf16_hi(h2));
                u32 l3 = tile_bf16x2(q.z - tile_bf16_lo(h3), q.w - tile_bf16_hi(h3));
#pragma unroll
                for (int j = 0; j < FG; ++j) {
                    const uint4 &r0 = a[u][j][0], &r1 = a[u][j][1];
                    mma_bf16(acc[j][t], r0.x, r1.x, r0.y, r1.y, h0, h1);
                    mma_bf16(acc[j][t], r0.x, r1.x, r0.y, r1.y, l0, l1);
                    mma_bf16(acc[j][t], r0.z, r1.z, r0.w, r1.w, h2, h3);
                    mma_bf16(acc[j][t], r0.z, r1.z, r0.w, r1.w, l2, l3);
                }
            }
        }
    }
    // A group at a time through the same shared tile: its warps' sums added in warp order.
#pragma unroll
    for (int j = 0; j < FG; ++j) {
        if (j > 0) __syncthreads();
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            red[warp][g][8 * t + 2 * tq] = acc[j][t][0];
            red[warp][g][8 * t + 2 * tq + 1] = acc[j][t][1];
            red[warp][g + 8][8 * t + 2 * tq] = acc[j][t][2];
            red[warp][g + 8][8 * t + 2 * tq + 1] = acc[j][t][3];
        }
        __syncthreads();
        int n0 = nb + 16 * j;
        for (int e = threadIdx.x; e < 16 * NT * 8; e += blockDim.x) {
            int f = e % 16, r = e / 16;
            float v = 0.0f;
#pragma unroll
            for (int w = 0; w < INV_WARPS; ++w) v += red[w][f][r];
            if (n0 + f < N && m0 + r < M) C[(long long)(m0 + r) * ldc + n0 + f] = v;
        }
    }
}

// Named by rows a block (NT · 8) and features a block (FG · 16). Row groups (blockIdx.y
// past the rows' blocks: DeepSeek-V4's wo_a, group g's M rows times its N weight rows
// into its M × N outputs) in one launch; one split only where there are groups.
#define INVARIANT_MV(NAME, NT, FG, U)                                                         \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                   \
        float* C, const float* X, const bf16_t* W, int M, int N, int K, int KS) {             \
        pdl_enter();                                                                          \
        int row_blocks = (M + NT * 8 - 1) / (NT * 8), grp = blockIdx.y / row_blocks;         \
        long long g = grp;                                                                    \
        invariant_mv<NT, FG, U>(C + g * M * N, N, X + g * M * K, InvBf16{W + g * N * K}, M, N, K, KS, \
                                blockIdx.y - grp * row_blocks);                               \
    }
INVARIANT_MV(matmul_invariant_mv1_kernel, 1, 1, 4)
INVARIANT_MV(matmul_invariant_mv2_kernel, 2, 1, 4)
INVARIANT_MV(matmul_invariant_mv4_kernel, 4, 1, 4)
INVARIANT_MV(matmul_invariant_wide_kernel, 4, 4, 1)

// The FP8 twins, on a part of a matrix (its N rows, columns of C at stride ldc). The same
// chunks a warp as the bf16 kernels, so a row's sums do not depend on the variant either.
#define INVARIANT_MV_FP8(NAME, NT, FG, U)                                                     \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                   \
        float* C, int ldc, const float* X, const u8* W, const float* scales, int block_rows,  \
        int block_cols, int M, int N, int K, int KS) {                                        \
        pdl_enter();                                                                          \
        invariant_mv<NT, FG, U>(C, ldc, X, InvFp8{W, scales, block_rows, block_cols}, M, N, K, KS, \
                                blockIdx.y);                                                  \
    }
INVARIANT_MV_FP8(matmul_invariant_fp8_mv1_kernel, 1, 1, 4)
INVARIANT_MV_FP8(matmul_invariant_fp8_mv2_kernel, 2, 1, 4)
INVARIANT_MV_FP8(matmul_invariant_fp8_mv4_kernel, 4, 1, 4)
INVARIANT_MV_FP8(matmul_invariant_fp8_wide_kernel, 4, 4, 1)

// C[i] = Σ_s P[s·n + i] over the KS splits of `invariant_mv`, in split order.
extern "C" __global__ void matmul_invariant_splits_kernel(float* C, const float* P, int KS, long long n) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = 0.0f;
    for (int s = 0; s < KS; ++s) v += P[s * n + i];
    C[i] = v;
}
