// The batch-invariant GEMM on the tensor cores (after llama.cu and mma_tile.cu): C[m, n] =
// Σ_k X[m, k] · W[n, k], X f32, W bf16, C f32, K a multiple of 8. A block's 8 warps split K
// by 32-column chunks (warp w takes chunks w, w + 8, …, each in order) and their sums are
// added in warp order: a row's arithmetic is the same whatever M is, which tile it lands in
// and where in an mma it sits (an mma's output depends on its own row of A and column of B
// only, and on which k slot each product takes: every variant puts the same columns in the
// same slots). Activations are f32-accurate: bf16 plus its bf16 remainder, two mmas
// (SGLang's fixed split, with the bf16 weights exact in the mma). Up to 8 rows a block
// (`invariant_mv`, NT = 1) the weights are the mma's A (16 features) and the rows its B,
// each warp streaming 4 chunks of loads straight into registers; past 8 rows
// (`invariant_mv_pipe` where it pays) pairs of 8-row tiles are the A and 8 features the B,
// each warp's chunks staged through its own shared stages by cp.async. Grid: (NT·8-row
// blocks, 16·FG-feature blocks, K splits); 256 threads.
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
    using Elem = bf16_t;
    const bf16_t* w;
};
struct InvFp8 {
    static constexpr bool FP8 = true;
    using Elem = u8;
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

// One 32-column chunk's products into acc: the lane's 8 columns of each 16-feature group
// (a[j][0] rows g, a[j][1] rows g + 8) times its 8 columns of each 8-row tile (p: columns
// 8tq + 0..3, q: 8tq + 4..7), the rows f32-accurate as bf16 plus its bf16 remainder. Every
// variant runs a chunk through this, so a row's sums are the same whichever.
template <int NT, int FG>
__device__ __forceinline__ void inv_chunk_mma(float (&acc)[FG][NT][4], const uint4 (&a)[FG][2],
                                              const float4 (&p)[NT], const float4 (&q)[NT]) {
    static_assert(NT == 1 || NT % 2 == 0, "past one tile, the rows are the mma's A in pairs of tiles");
    // Columns 8tq + 0..3 are the first k16 step's, 8tq + 4..7 the second's, for the weights
    // and the rows alike: b[t][0..1] the first step's high halves, [2..3] its remainders,
    // [4..7] the second step's.
    u32 b[NT][8];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        b[t][0] = tile_bf16x2(p[t].x, p[t].y), b[t][1] = tile_bf16x2(p[t].z, p[t].w);
        b[t][4] = tile_bf16x2(q[t].x, q[t].y), b[t][5] = tile_bf16x2(q[t].z, q[t].w);
        b[t][2] = tile_bf16x2(p[t].x - tile_bf16_lo(b[t][0]), p[t].y - tile_bf16_hi(b[t][0]));
        b[t][3] = tile_bf16x2(p[t].z - tile_bf16_lo(b[t][1]), p[t].w - tile_bf16_hi(b[t][1]));
        b[t][6] = tile_bf16x2(q[t].x - tile_bf16_lo(b[t][4]), q[t].y - tile_bf16_hi(b[t][4]));
        b[t][7] = tile_bf16x2(q[t].z - tile_bf16_lo(b[t][5]), q[t].w - tile_bf16_hi(b[t][5]));
    }
    // Each accumulator takes its four products in the same order (high, remainder; first
    // step, second); between them the other accumulators' products, so that the tensor
    // cores are not left waiting on one accumulator's chain of four.
    if constexpr (NT == 1) {
        // The weights as the mma's A (16 features), the rows its B (8).
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int j = 0; j < FG; ++j) {
                const uint4 &r0 = a[j][0], &r1 = a[j][1];
                u32 w0 = s < 2 ? r0.x : r0.z, w1 = s < 2 ? r1.x : r1.z;
                u32 w2 = s < 2 ? r0.y : r0.w, w3 = s < 2 ? r1.y : r1.w;
                mma_bf16(acc[j][0], w0, w1, w2, w3, b[0][2 * s], b[0][2 * s + 1]);
            }
    } else {
        // Two 8-row tiles as the mma's A (16 rows), 8 features its B: a feature's 8 columns
        // are one lane's two B words as loaded, where as A they had to be interleaved with
        // another feature's (register moves outnumbered the mmas four to one). The same
        // columns in the same k slots: a product's sums are bit for bit those of NT = 1.
        // acc[j][2·tp + h]: features 16j + 8h.., rows of tiles 2tp and 2tp + 1.
#pragma unroll
        for (int s = 0; s < 4; ++s)
#pragma unroll
            for (int tp = 0; tp < NT / 2; ++tp)
#pragma unroll
                for (int j = 0; j < FG; ++j)
#pragma unroll
                    for (int h = 0; h < 2; ++h) {
                        const uint4& r = a[j][h];
                        mma_bf16(acc[j][2 * tp + h], b[2 * tp][2 * s], b[2 * tp + 1][2 * s],
                                 b[2 * tp][2 * s + 1], b[2 * tp + 1][2 * s + 1], s < 2 ? r.x : r.z,
                                 s < 2 ? r.y : r.w);
                    }
    }
}

// The block's 8 warps' sums of its features nb.. and rows m0.. into C, added in warp order.
template <int NT, int FG>
__device__ __forceinline__ void inv_store(float (&acc)[FG][NT][4], float* C, int ldc, int nb, int m0,
                                          int M, int N) {
    __shared__ float red[INV_WARPS][16][NT * 8];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, tq = lane & 3;
    // A group at a time through the same shared tile: its warps' sums added in warp order.
#pragma unroll
    for (int j = 0; j < FG; ++j) {
        if (j > 0) __syncthreads();
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            if constexpr (NT == 1) {
                red[warp][g][8 * t + 2 * tq] = acc[j][t][0];
                red[warp][g][8 * t + 2 * tq + 1] = acc[j][t][1];
                red[warp][g + 8][8 * t + 2 * tq] = acc[j][t][2];
                red[warp][g + 8][8 * t + 2 * tq + 1] = acc[j][t][3];
            } else {
                // Rows g and g + 8 of tile pair t / 2, features 8h + 2tq and the next.
                int h = t & 1, r = 16 * (t >> 1) + g, f = 8 * h + 2 * tq;
                red[warp][f][r] = acc[j][t][0];
                red[warp][f + 1][r] = acc[j][t][1];
                red[warp][f][r + 8] = acc[j][t][2];
                red[warp][f + 1][r + 8] = acc[j][t][3];
            }
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

// KS splits of K (blockIdx.z): split s's warp w takes chunks 8s + w, 8s + w + 8·KS, …, and
// writes its sums to C + s·M·ldc, for `matmul_invariant_splits_kernel` to add in split
// order. KS comes from the matrix's shape alone, so a row's sums still do not depend on
// the batch; it puts a narrow matrix (mHC's 24 features over 16 384 columns: 2 blocks)
// on enough SMs.
template <int NT, int FG, int U, typename WT>
__device__ void invariant_mv(float* C, int ldc, const float* X, WT W, int M, int N, int K, int KS,
                             int row_block) {
    constexpr bool FP8 = WT::FP8;
    int split = blockIdx.z;
    C += (long long)split * M * ldc;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, tq = lane & 3;
    int nb = blockIdx.y * 16 * FG, m0 = row_block * NT * 8;
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
            float4 p[NT], q[NT];
#pragma unroll
            for (int t = 0; t < NT; ++t) {
                p[t] = q[t] = make_float4(0.f, 0.f, 0.f, 0.f);
                if (in && live[t]) {
                    p[t] = *(const float4*)(xr[t] + k);
                    q[t] = *(const float4*)(xr[t] + k + 4);
                }
            }
            inv_chunk_mma<NT, FG>(acc, a[u], p, q);
        }
    }
    inv_store<NT, FG>(acc, C, ldc, nb, m0, M, N);
}

// The same chunks, products and sums as `invariant_mv` (so a row's bits are the same in
// either), with each warp's chunks streamed into its own S shared stages by cp.async, S − 1
// ahead of the one multiplied: `invariant_mv` holds its loads in registers, which at 32+
// rows leaves one chunk in flight a warp (batch 64: +3 % here; at 16 rows the register
// version, with more blocks an SM, stays faster). No barrier in the loop: a warp's stages
// are its own.
// A stage: the chunk's FG·16 weight rows (64 bytes bf16, 32 FP8), then its NT·8 rows of
// X (128 bytes f32, padded to INV_ACT_ROW so a quarter-warp's 16-byte reads miss each
// other's banks). Rows and columns out of range arrive as zeros, as `invariant_mv` reads.
#define INV_ACT_ROW 144  // invariant.rs (`invariant_mv_smem_bytes`) sizes the stages alike
template <int NT, int FG, bool FP8>
struct InvStage {
    static constexpr int W_ROW = FP8 ? 32 : 64;
    static constexpr int W_BYTES = FG * 16 * W_ROW;
    static constexpr int BYTES = W_BYTES + NT * 8 * INV_ACT_ROW;
};

// cp.async of CP bytes to the shared address `smem`, zeros where `full` is false (a source
// size of 0 reads nothing).
template <int CP>
__device__ __forceinline__ void inv_cp_async(u32 smem, const void* gmem, bool full) {
    int src = full ? CP : 0;
    if constexpr (CP == 16)
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem), "l"(gmem), "r"(src) : "memory");
    else
        asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;" ::"r"(smem), "l"(gmem), "r"(src) : "memory");
}

template <int NT, int FG, int S, typename WT>
__device__ void invariant_mv_pipe(float* C, int ldc, const float* X, WT W, int M, int N, int K,
                                  int KS, int row_block) {
    constexpr bool FP8 = WT::FP8;
    using St = InvStage<NT, FG, FP8>;
    extern __shared__ __align__(16) unsigned char inv_stages[];
    int split = blockIdx.z;
    C += (long long)split * M * ldc;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, tq = lane & 3;
    int nb = blockIdx.y * 16 * FG, m0 = row_block * NT * 8;
    unsigned char* mine = inv_stages + warp * S * St::BYTES;
    int chunks = (K + 31) / 32, first = INV_WARPS * split + warp, stride = INV_WARPS * KS;
    int count = first < chunks ? (chunks - first + stride - 1) / stride : 0;
    // A lane's copies, the same rows and columns of every chunk (the chunk moves the
    // addresses only): weight rows (lane >> 2) + 8i, 8 columns at 8·(lane & 3) (16 bytes
    // bf16, 8 FP8); X rows (lane >> 3) + 4i, 4 columns at 4·(lane & 7). Their addresses are
    // made once: the loop is issue-bound, and rebuilding them took most of its instructions.
    constexpr int W_COPIES = FG * 16 * 4 / 32, X_COPIES = NT * 8 * 8 / 32;
    const typename WT::Elem* wp[W_COPIES];
    const float* xp[X_COPIES];
    u32 x_live = 0;
#pragma unroll
    for (int i = 0; i < W_COPIES; ++i) {
        int f = nb + (lane >> 2) + 8 * i;
        // Features past N read row 0 (valid); their sums are not stored.
        wp[i] = W.w + (long long)(f < N ? f : 0) * K + 8 * (lane & 3);
    }
#pragma unroll
    for (int i = 0; i < X_COPIES; ++i) {
        int r = m0 + (lane >> 3) + 4 * i;
        x_live |= (r < M ? 1u : 0u) << i;
        xp[i] = X + (long long)(r < M ? r : 0) * K + 4 * (lane & 7);
    }
    // FP8: the block scales' rows of the lane's features g and g + 8 of each group.
    const float* scale_rows[FG][2];
    if constexpr (FP8) {
        const InvFp8& w = W;
        int grid_cols = (K + w.block_cols - 1) / w.block_cols;
#pragma unroll
        for (int j = 0; j < FG; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                int f = nb + 16 * j + g + 8 * h;
                scale_rows[j][h] = w.scales + (long long)((f < N ? f : 0) / w.block_rows) * grid_cols;
            }
    }
    u32 my_stages = (u32)__cvta_generic_to_shared(mine);
    u32 w_dst = ((lane >> 2) * St::W_ROW) + (FP8 ? 8 : 16) * (lane & 3);
    u32 x_dst = St::W_BYTES + (lane >> 3) * INV_ACT_ROW + 16 * (lane & 7);
    auto issue = [&](int i) {
        u32 st = my_stages + (i % S) * St::BYTES;
        int k0 = (first + i * stride) * 32;
        bool w_in = k0 + 8 * (lane & 3) < K, x_in = k0 + 4 * (lane & 7) < K;
#pragma unroll
        for (int j = 0; j < W_COPIES; ++j)
            inv_cp_async<FP8 ? 8 : 16>(st + w_dst + j * 8 * St::W_ROW, wp[j] + (w_in ? k0 : 0), w_in);
#pragma unroll
        for (int j = 0; j < X_COPIES; ++j) {
            bool in = x_in && (x_live >> j & 1);
            inv_cp_async<16>(st + x_dst + j * 4 * INV_ACT_ROW, xp[j] + (in ? k0 : 0), in);
        }
    };
    float acc[FG][NT][4];
#pragma unroll
    for (int j = 0; j < FG; ++j)
#pragma unroll
        for (int t = 0; t < NT; ++t) acc[j][t][0] = acc[j][t][1] = acc[j][t][2] = acc[j][t][3] = 0.0f;
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
        if (i < count) issue(i);
        cp_async_commit();
    }
    for (int i = 0; i < count; ++i) {
        cp_async_wait<S - 2>();  // chunk i has landed (this lane's copies)
        __syncwarp();            // and the other lanes'; all are done with chunk i − 1's stage
        if (i + S - 1 < count) issue(i + S - 1);
        cp_async_commit();
        const unsigned char* st = mine + (i % S) * St::BYTES;
        int k = (first + i * stride) * 32 + 8 * tq;
        uint4 a[FG][2];
#pragma unroll
        for (int j = 0; j < FG; ++j) {
            const unsigned char* w0 = st + (16 * j + g) * St::W_ROW;
            const unsigned char* w1 = w0 + 8 * St::W_ROW;
            if constexpr (FP8) {
                int kc = (k < K ? k : 0) / W.block_cols;
                a[j][0] = inv_fp8_words(*(const uint2*)(w0 + 8 * tq), scale_rows[j][0][kc]);
                a[j][1] = inv_fp8_words(*(const uint2*)(w1 + 8 * tq), scale_rows[j][1][kc]);
            } else {
                a[j][0] = *(const uint4*)(w0 + 16 * tq);
                a[j][1] = *(const uint4*)(w1 + 16 * tq);
            }
        }
        float4 p[NT], q[NT];
#pragma unroll
        for (int t = 0; t < NT; ++t) {
            const float4* x = (const float4*)(st + St::W_BYTES + (8 * t + g) * INV_ACT_ROW + 32 * tq);
            p[t] = x[0];
            q[t] = x[1];
        }
        inv_chunk_mma<NT, FG>(acc, a, p, q);
    }
    inv_store<NT, FG>(acc, C, ldc, nb, m0, M, N);
}

// Named by rows a block (NT · 8) and features a block (FG · 16). Row groups (blockIdx.x
// past the rows' blocks: DeepSeek-V4's wo_a, group g's M rows times its N weight rows
// into its M × N outputs) in one launch; one split only where there are groups.
#define INVARIANT_MV(NAME, BODY, NT, FG, U)                                                   \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                   \
        float* C, const float* X, const bf16_t* W, int M, int N, int K, int KS) {             \
        pdl_enter();                                                                          \
        int row_blocks = (M + NT * 8 - 1) / (NT * 8), grp = blockIdx.x / row_blocks;         \
        long long g = grp;                                                                    \
        BODY<NT, FG, U>(C + g * M * N, N, X + g * M * K, InvBf16{W + g * N * K}, M, N, K, KS, \
                                blockIdx.x - grp * row_blocks);                               \
    }
// mv1: U chunks in registers; the others: S stages (`INV_STAGES` in invariant.rs).
INVARIANT_MV(matmul_invariant_mv1_kernel, invariant_mv, 1, 1, 4)
INVARIANT_MV(matmul_invariant_mv2_kernel, invariant_mv, 2, 1, 4)
INVARIANT_MV(matmul_invariant_mv4_kernel, invariant_mv_pipe, 4, 1, 3)
INVARIANT_MV(matmul_invariant_wide_kernel, invariant_mv_pipe, 4, 4, 3)

// The FP8 twins, on a part of a matrix (its N rows, columns of C at stride ldc). The same
// chunks a warp as the bf16 kernels, so a row's sums do not depend on the variant either.
#define INVARIANT_MV_FP8(NAME, BODY, NT, FG, U)                                               \
    extern "C" __global__ void __launch_bounds__(256) NAME(                                   \
        float* C, int ldc, const float* X, const u8* W, const float* scales, int block_rows,  \
        int block_cols, int M, int N, int K, int KS) {                                        \
        pdl_enter();                                                                          \
        BODY<NT, FG, U>(C, ldc, X, InvFp8{W, scales, block_rows, block_cols}, M, N, K, KS,        \
                                blockIdx.x);                                                  \
    }
INVARIANT_MV_FP8(matmul_invariant_fp8_mv1_kernel, invariant_mv, 1, 1, 4)
INVARIANT_MV_FP8(matmul_invariant_fp8_mv2_kernel, invariant_mv, 2, 1, 4)
INVARIANT_MV_FP8(matmul_invariant_fp8_mv4_kernel, invariant_mv_pipe, 4, 1, 3)
INVARIANT_MV_FP8(matmul_invariant_fp8_wide_kernel, invariant_mv_pipe, 4, 4, 3)

// C[i] = Σ_s P[s·n + i] over the KS splits of `invariant_mv`, in split order.
extern "C" __global__ void matmul_invariant_splits_kernel(float* C, const float* P, int KS, long long n) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float v = 0.0f;
    for (int s = 0; s < KS; ++s) v += P[s * n + i];
    C[i] = v;
}
