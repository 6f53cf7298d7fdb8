// The batch-invariant GEMM on the tensor cores (after llama.cu and mma_tile.cu): C[m, n] =
// Σ_k X[m, k] · W[n, k], X f32, W bf16, C f32, K a multiple of 8. The weights are the
// mma's A operand (16 features a warp) and the rows its B (8 a tile, up to NT tiles a
// block), so a decode batch streams the weights straight from global memory into
// fragments — no shared staging, no barrier inside the loop — with INV_UNROLL 32-column
// chunks of loads in flight per warp. A block's 8 warps split K by chunks (warp w takes
// chunks w, w + 8, …, each in order) and their sums are added in warp order: a row's
// arithmetic is the same whatever M is, which tile it lands in and in which of a tile's
// columns (an mma's output column depends on its own column of B only). Activations are
// f32-accurate: bf16 plus its bf16 remainder, two mmas (SGLang's fixed split, with the
// bf16 weights exact in the mma). Grid: (16-feature blocks, NT·8-row groups); 256 threads.
#define INV_WARPS 8
#define INV_UNROLL 4

// 16 bytes of weights, issued where written: ptxas otherwise sinks each load to its first
// use, leaving one chunk in flight.
__device__ __forceinline__ uint4 inv_load16(const bf16_t* p) {
    uint4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

template <int NT>
__device__ void invariant_mv(float* C, const float* X, const bf16_t* W, int M, int N, int K) {
    __shared__ float red[INV_WARPS][16][NT * 8];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, tq = lane & 3;
    int n0 = blockIdx.x * 16, m0 = blockIdx.y * NT * 8;
    // Features past N read row n0 (valid); their sums are not stored.
    long long f0 = n0 + g < N ? n0 + g : n0, f1 = n0 + g + 8 < N ? n0 + g + 8 : n0;
    const bf16_t* w0 = W + f0 * K + 8 * tq;
    const bf16_t* w1 = W + f1 * K + 8 * tq;
    const float* xr[NT];
    bool live[NT];
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        int r = m0 + 8 * t + g;
        live[t] = r < M;
        xr[t] = X + (long long)(live[t] ? r : 0) * K + 8 * tq;
    }
    float acc[NT][4];
#pragma unroll
    for (int t = 0; t < NT; ++t) acc[t][0] = acc[t][1] = acc[t][2] = acc[t][3] = 0.0f;
    int chunks = (K + 31) / 32;
    for (int c0 = warp; c0 < chunks; c0 += INV_WARPS * INV_UNROLL) {
        uint4 a[INV_UNROLL][2];
#pragma unroll
        for (int u = 0; u < INV_UNROLL; ++u) {
            int k = (c0 + u * INV_WARPS) * 32;
            bool in = c0 + u * INV_WARPS < chunks && k + 8 * tq < K;
            a[u][0] = in ? inv_load16(w0 + k) : make_uint4(0, 0, 0, 0);
            a[u][1] = in ? inv_load16(w1 + k) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < INV_UNROLL; ++u) {
            int k = (c0 + u * INV_WARPS) * 32;
            bool in = c0 + u * INV_WARPS < chunks && k + 8 * tq < K;
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
                const uint4 &r0 = a[u][0], &r1 = a[u][1];
                mma_bf16(acc[t], r0.x, r1.x, r0.y, r1.y, h0, h1);
                mma_bf16(acc[t], r0.x, r1.x, r0.y, r1.y, l0, l1);
                mma_bf16(acc[t], r0.z, r1.z, r0.w, r1.w, h2, h3);
                mma_bf16(acc[t], r0.z, r1.z, r0.w, r1.w, l2, l3);
            }
        }
    }
#pragma unroll
    for (int t = 0; t < NT; ++t) {
        red[warp][g][8 * t + 2 * tq] = acc[t][0];
        red[warp][g][8 * t + 2 * tq + 1] = acc[t][1];
        red[warp][g + 8][8 * t + 2 * tq] = acc[t][2];
        red[warp][g + 8][8 * t + 2 * tq + 1] = acc[t][3];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < 16 * NT * 8; e += blockDim.x) {
        int f = e % 16, r = e / 16;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < INV_WARPS; ++w) v += red[w][f][r];
        if (n0 + f < N && m0 + r < M) C[(long long)(m0 + r) * N + n0 + f] = v;
    }
}

#define INVARIANT_MV(NT)                                                                      \
    extern "C" __global__ void __launch_bounds__(256) matmul_invariant_mv##NT##_kernel(       \
        float* C, const float* X, const bf16_t* W, int M, int N, int K) {                     \
        pdl_enter();                                                                          \
        invariant_mv<NT>(C, X, W, M, N, K);                                                   \
    }
INVARIANT_MV(1)
INVARIANT_MV(2)
INVARIANT_MV(4)
