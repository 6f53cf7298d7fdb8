// y[i, n] = Σ_k x[i, k] · W[n, k] for the few rows of a small decode batch (appended to
// llama.cu's source). Such a product is one pass over the weights, so the kernel is built
// to stream them: a block owns COLS output columns and its 8 warps split K between them, so
// that even a short, wide matrix (N = 4096, K = 14336) puts thousands of warps in flight;
// lanes read 16 bytes (8 bf16) of a column per load and hold GEMV_UNROLL loads in flight.
// x stays f32, read through the cache (no bf16 copy of it). K must be a multiple of 8. Rows
// are compiled up to MAXM and guarded at run time for fewer; more rows, more columns per
// block, so that each x load serves more weights. 256 threads.
#define GEMV_WARPS 8
#define GEMV_UNROLL 4
// A narrow matrix (too few output columns for a block an SM at COLS a block: DeepSeek-V4's
// 24-row mHC projections over K = 16 384, its router and indexer weights) takes one
// column a block of 16 warps, so that the whole matrix is in flight at once (12 blocks of
// 8 warps read the mHC projection at 0.14 TB/s).
#define GEMV_NARROW_WARPS 16

__device__ __forceinline__ float dot8_bf16(uint4 w, float4 a, float4 b) {
    float s = a.x * __uint_as_float(w.x << 16);
    s = fmaf(a.y, __uint_as_float(w.x & 0xffff0000u), s);
    s = fmaf(a.z, __uint_as_float(w.y << 16), s);
    s = fmaf(a.w, __uint_as_float(w.y & 0xffff0000u), s);
    s = fmaf(b.x, __uint_as_float(w.z << 16), s);
    s = fmaf(b.y, __uint_as_float(w.z & 0xffff0000u), s);
    s = fmaf(b.z, __uint_as_float(w.w << 16), s);
    s = fmaf(b.w, __uint_as_float(w.w & 0xffff0000u), s);
    return s;
}

template <int MAXM, int COLS, bool SILU, int WARPS = GEMV_WARPS>
__device__ void gemv(float* y, const float* x, const bf16_t* W, int m, int N, int K) {
    __shared__ float partial[WARPS][MAXM][COLS];
    constexpr int OUT = SILU ? COLS / 2 : COLS;  // output columns of the block
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    long long n0 = (long long)blockIdx.x * OUT;
    long long width = SILU ? N / 2 : N;
    float acc[MAXM][COLS];
#pragma unroll
    for (int i = 0; i < MAXM; ++i)
#pragma unroll
        for (int c = 0; c < COLS; ++c) acc[i][c] = 0.0f;
    const bf16_t* wc[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        long long col = n0 + c % OUT;  // past the end: a valid row, its sum unused
        wc[c] = W + ((col < width ? col : n0) + (c < OUT ? 0 : width)) * (long long)K;
    }
#pragma unroll GEMV_UNROLL
    for (int k = (warp * 32 + lane) * 8; k < K; k += WARPS * 256) {
        uint4 w[COLS];
#pragma unroll
        for (int c = 0; c < COLS; ++c) w[c] = *(const uint4*)(wc[c] + k);
#pragma unroll
        for (int i = 0; i < MAXM; ++i) {
            if (i >= m) break;
            const float* xr = x + (long long)i * K + k;
            float4 a = *(const float4*)xr, b = *(const float4*)(xr + 4);
#pragma unroll
            for (int c = 0; c < COLS; ++c) acc[i][c] += dot8_bf16(w[c], a, b);
        }
    }
#pragma unroll
    for (int i = 0; i < MAXM; ++i)
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            float v = warp_sum(acc[i][c]);
            if (lane == 0) partial[warp][i][c] = v;
        }
    __syncthreads();
    int e = threadIdx.x;
    if (e < MAXM * OUT) {
        int i = e / OUT, c = e % OUT;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) v += partial[w][i][c];
        if (SILU) {  // silu_mul_kernel's arithmetic
            float u = 0.0f;
#pragma unroll
            for (int w = 0; w < WARPS; ++w) u += partial[w][i][c + OUT];
            v = v / (1.0f + expf(-v)) * u;
        }
        if (i < m && n0 + c < width) y[(long long)i * width + n0 + c] = v;
    }
}

#define GEMV_ENTRY(MAXM, COLS)                                                                \
    extern "C" __global__ void __launch_bounds__(256) gemv_##MAXM##_kernel(                   \
        float* y, const float* x, const bf16_t* W, int m, int N, int K) {                     \
        pdl_enter();                                                                          \
        gemv<MAXM, COLS, false>(y, x, W, m, N, K);                                            \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) gemv_silu_##MAXM##_kernel(              \
        float* y, const float* x, const bf16_t* W, int m, int N, int K) {                     \
        pdl_enter();                                                                          \
        gemv<MAXM, COLS, true>(y, x, W, m, N, K);                                             \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(256) gemv_groups_##MAXM##_kernel(            \
        float* y, const float* x, const bf16_t* W, int m, int N, int K) {                     \
        pdl_enter();                                                                          \
        long long g = blockIdx.y; /* group g: its m rows of x, its N rows of W */             \
        gemv<MAXM, COLS, false>(y + g * m * N, x + g * m * K, W + g * N * K, m, N, K);        \
    }                                                                                         \
    extern "C" __global__ void __launch_bounds__(GEMV_NARROW_WARPS * 32)                      \
        gemv_narrow_##MAXM##_kernel(float* y, const float* x, const bf16_t* W, int m, int N,  \
                                    int K) {                                                  \
        pdl_enter();                                                                          \
        gemv<MAXM, 1, false, GEMV_NARROW_WARPS>(y, x, W, m, N, K);                            \
    }
GEMV_ENTRY(1, 2)
GEMV_ENTRY(2, 2)
GEMV_ENTRY(4, 4)
