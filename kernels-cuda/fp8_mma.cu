// The FP8 GEMV on tensor cores, for up to 8 rows of x (appended to llama.cu's source after
// packed.cu): a warp multiplies 16 weight rows by the rows of x with mma.m16n8k16 (f16
// operands, f32 sums), so a weight costs no FMA of its own. A thread loads 16 consecutive
// bytes of its two rows; the dot product does not care in which order k is summed, so each
// mma's 16 "columns" are the bytes the fragment layout puts in the thread's registers, and
// x is gathered in that same order. The 8 warps of a block split K in 64-wide steps (each
// inside one scale block: block_cols a multiple of 64, or all of K) and issue a batch of
// steps' loads before using any.
//
// Where x fits in shared memory (m · K · 2 bytes ≤ TC_STAGE_BYTES: batch-1 decode at every
// width) the block converts it to f16 there once ("staged"): registers then hold only
// weights, twice as many steps are in flight, and the first batch is loaded before the
// kernel waits for its predecessor (weights do not depend on it), so the stream starts
// while the previous kernel drains. Otherwise each thread loads its x with its weights.
#define TC_WARPS 8
#define TC_STAGE_BYTES 40960

__device__ __forceinline__ u32 f32x2_to_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// e4m3 bytes 1 and 3 of `q` as f16x2 (byte 1 the low half), and bytes 0 and 2: each f16 is
// its e4m3 times 2^-8, exact, subnormals included (the sign stays, the 7 magnitude bits
// move one place down into the f16's exponent and mantissa). Integer ops only: the
// conversion instruction runs at a quarter of their rate.
__device__ __forceinline__ void e4m3x4_to_f16(u32 q, u32& odd, u32& even) {
    odd = (q & 0x80008000u) | ((q & 0x7F007F00u) >> 1);
    q <<= 8;
    even = (q & 0x80008000u) | ((q & 0x7F007F00u) >> 1);
}

// x goes to f16 times 2^-4: 2^20 is then the largest |x| it holds (f16 alone overflows
// past 65504, and a down projection's input can be large), and values below 2^-10 lose
// bits as f16 subnormals, an absolute error under 2^-21 — finer than bf16 operands'.
#define TC_X_SCALE 0.0625f
// Undoes both: 2^8 for the weights, 2^4 for x.
#define TC_UNSCALE 4096.0f

// x[k .. k + 4) as the two B registers of the mma whose A columns are bytes (1, 3) and
// (0, 2) of a weight word.
__device__ __forceinline__ uint2 x_fragment(float4 v) {
    return make_uint2(f32x2_to_f16x2(v.y * TC_X_SCALE, v.w * TC_X_SCALE),
                      f32x2_to_f16x2(v.x * TC_X_SCALE, v.z * TC_X_SCALE));
}

// One 64-wide step: 16 bytes of row g (p) and of row g + 8 (q) against x's fragments.
__device__ __forceinline__ void tc_step(uint4 p, uint4 q, const uint2 xf[4], float c[4]) {
    u32 pw[4] = {p.x, p.y, p.z, p.w}, qw[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
    for (int s = 0; s < 4; ++s) {
        u32 a0, a2, a1, a3;
        e4m3x4_to_f16(pw[s], a0, a2);
        e4m3x4_to_f16(qw[s], a1, a3);
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
            "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
            : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
            : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(xf[s].x), "r"(xf[s].y));
    }
}

// SILU: the stacked [gate; up] of an MLP (N = 2 · width) in, silu(gate) · up out — a
// block's 16 rows are 8 gate rows and their up partners, so one thread holds both sums.
// ROWS (staged, not SILU): each warp takes its own 16 rows over the whole K — for short K
// and many rows (DeepSeek-V4's q_b: K 1 024, 32 768 rows), where 16 rows a block left each
// block two steps a warp and its fixed costs (staging x, the exchange between warps)
// most of its time; x is staged once for 128 rows and no warp waits for another.
template <bool SILU, bool STAGED, bool ROWS = false>
__device__ void gemv_fp8_mma(float* y, int ldy, const float* x, const u8* W, const float* scales,
                             int block_rows, int block_cols, int m, int N, int K) {
    constexpr int DEPTH = STAGED ? 8 : 4;
    constexpr int STEP = ROWS ? 64 : TC_WARPS * 64;
    __shared__ float partial[TC_WARPS][16][8];
    extern __shared__ uint2 xs[];  // staged: x[i][k / 4] as x_fragment
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    long long r0, r1;
    if (SILU) {
        long long width = N / 2, n = (long long)blockIdx.x * 8 + g;
        r0 = n < width ? n : 0;
        r1 = width + r0;
    } else {
        long long n0 = (long long)blockIdx.x * (ROWS ? 16 * TC_WARPS : 16) + (ROWS ? 16 * warp : 0);
        // Rows past N read the last row (their sums are not stored).
        r0 = min(n0 + g, (long long)N - 1);
        r1 = min(n0 + g + 8, (long long)N - 1);
    }
    const u8* w0 = W + r0 * K + t * 16;
    const u8* w1 = W + r1 * K + t * 16;
    int grid_cols = (K + block_cols - 1) / block_cols;
    const float* s0 = scales + (r0 / block_rows) * grid_cols;
    const float* s1 = scales + (r1 / block_rows) * grid_cols;
    bool has_x = g < m;  // lane group g holds x row g (the mma's n)
    const float* xg = x + (long long)(has_x ? g : 0) * K + t * 16;
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    uint4 p[DEPTH], q[DEPTH];
    auto load_weights = [&](int kb0) {
#pragma unroll
        for (int d = 0; d < DEPTH; ++d)
            if (kb0 + d * STEP < K) {
                p[d] = *(const uint4*)(w0 + kb0 + d * STEP);
                q[d] = *(const uint4*)(w1 + kb0 + d * STEP);
            }
    };
    const int k_first = ROWS ? 0 : warp * 64;
    if (STAGED) load_weights(k_first);
    pdl_enter();
    if (STAGED) {
        for (int e = threadIdx.x; e < m * K / 4; e += TC_WARPS * 32)
            xs[e] = x_fragment(((const float4*)x)[e]);
        __syncthreads();
    }
    for (int kb0 = k_first; kb0 < K; kb0 += STEP * DEPTH) {
        float4 xv[STAGED ? 1 : DEPTH][4];
        if (!STAGED || kb0 != k_first) load_weights(kb0);
        if (!STAGED)
#pragma unroll
            for (int d = 0; d < DEPTH; ++d)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    xv[d][j] = has_x && kb0 + d * STEP < K
                                   ? ((const float4*)(xg + kb0 + d * STEP))[j]
                                   : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int d = 0; d < DEPTH; ++d) {
            int kb = kb0 + d * STEP;
            if (kb >= K) break;
            uint2 xf[4];
            if (STAGED) {
                const uint4* xr = (const uint4*)(xs + (long long)(has_x ? g : 0) * (K / 4) +
                                                 (kb + t * 16) / 4);
                uint4 lo = xr[0], hi = xr[1];
                xf[0] = make_uint2(lo.x, lo.y);
                xf[1] = make_uint2(lo.z, lo.w);
                xf[2] = make_uint2(hi.x, hi.y);
                xf[3] = make_uint2(hi.z, hi.w);
                if (!has_x)
#pragma unroll
                    for (int s = 0; s < 4; ++s) xf[s] = make_uint2(0u, 0u);
            } else {
#pragma unroll
                for (int s = 0; s < 4; ++s) xf[s] = x_fragment(xv[STAGED ? 0 : d][s]);
            }
            float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            tc_step(p[d], q[d], xf, c);
            float sc0 = s0[kb / block_cols] * TC_UNSCALE, sc1 = s1[kb / block_cols] * TC_UNSCALE;
            acc[0] = fmaf(sc0, c[0], acc[0]);
            acc[1] = fmaf(sc0, c[1], acc[1]);
            acc[2] = fmaf(sc1, c[2], acc[2]);
            acc[3] = fmaf(sc1, c[3], acc[3]);
        }
    }
    // c0, c1: weight row g, x rows 2t and 2t + 1; c2, c3: weight row g + 8.
    if (ROWS) {
        long long n = (long long)blockIdx.x * 16 * TC_WARPS + 16 * warp + g;
        if (n < N && 2 * t < m) y[(long long)(2 * t) * ldy + n] = acc[0];
        if (n < N && 2 * t + 1 < m) y[(long long)(2 * t + 1) * ldy + n] = acc[1];
        if (n + 8 < N && 2 * t < m) y[(long long)(2 * t) * ldy + n + 8] = acc[2];
        if (n + 8 < N && 2 * t + 1 < m) y[(long long)(2 * t + 1) * ldy + n + 8] = acc[3];
        return;
    }
    partial[warp][g][2 * t] = acc[0];
    partial[warp][g][2 * t + 1] = acc[1];
    partial[warp][g + 8][2 * t] = acc[2];
    partial[warp][g + 8][2 * t + 1] = acc[3];
    __syncthreads();
    if (SILU) {
        if (threadIdx.x < 64) {
            int row = threadIdx.x >> 3, i = threadIdx.x & 7;  // 8 gate rows × 8 x rows
            float v = 0.0f, u = 0.0f;
#pragma unroll
            for (int w = 0; w < TC_WARPS; ++w) {
                v += partial[w][row][i];
                u += partial[w][row + 8][i];
            }
            long long width = N / 2, n = (long long)blockIdx.x * 8 + row;
            if (i < m && n < width) y[(long long)i * width + n] = v / (1.0f + expf(-v)) * u;
        }
        return;
    }
    if (threadIdx.x < 128) {
        int row = threadIdx.x >> 3, i = threadIdx.x & 7;  // 16 rows × 8 x rows
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < TC_WARPS; ++w) v += partial[w][row][i];
        long long n = (long long)blockIdx.x * 16 + row;
        if (i < m && n < N) y[(long long)i * ldy + n] = v;
    }
}

#define TC_ENTRY(NAME, SILU, STAGED, ROWS)                                                     \
    extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, 2)                             \
        NAME(float* y, int ldy, const float* x, const u8* W, const float* scales,              \
             int block_rows, int block_cols, int m, int N, int K) {                            \
        gemv_fp8_mma<SILU, STAGED, ROWS>(y, ldy, x, W, scales, block_rows, block_cols, m, N, K);\
    }
TC_ENTRY(gemv_fp8_mma_kernel, false, false, false)
TC_ENTRY(gemv_fp8_mma_staged_kernel, false, true, false)
TC_ENTRY(gemv_fp8_mma_rows_kernel, false, true, true)
TC_ENTRY(gemv_fp8_mma_silu_kernel, true, true, false)
