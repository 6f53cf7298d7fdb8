// Many rows a tile of MXFP4 experts (a prefill's routed pairs): a pipelined grouped GEMM
// (appended after moe.cu; `mma_bf16`, `tile_e2m1x4` from mma_tile.cu). The tile GEMM's
// many-row shape ran at 50–63 TFLOP/s: 4 warps, each 32-column block's weights loaded
// byte by byte right before the mma that needs them, the rows staged between two barriers.
// Here 8 warps (2 along the rows × 4 along the features, a warp 32 rows × 32 features of
// each matrix) work on chunks of MP_KC columns that cp.async brings into one of two
// stages while the other's products run: the rows as f32 (16-byte copies; made bf16 when
// the fragments are built), the weights as stored (each feature's 4 blocks of 17 bytes,
// 4-byte aligned at this chunk size). The k order inside a 32-column block is tile_gemm's
// (lane q takes columns 8q .. 8q + 7 as two k16 steps), so the sums are the same products
// in the same mma order as the 4-warp kernel's. K a multiple of MP_KC; 256 threads;
// dynamic shared memory MP_SMEM_BYTES(matrices).
#define MP_BM 64
#define MP_BN 128
#define MP_KC 128
#define MP_XS (MP_KC + 4)  // f32 row stride: a quarter-warp's float4 reads in distinct banks
#define MP_WROW 68         // a feature's bytes in a chunk: 4 MXFP4 blocks
#define MP_THREADS 256
#define MP_SMEM_BYTES(mats) (2 * (MP_BM * MP_XS * 4 + (mats) * MP_BN * MP_WROW))

__device__ __forceinline__ u32 mp_smem(const void* p) {
    u32 s;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(s) : "l"(p));
    return s;
}
__device__ __forceinline__ void mp_copy16(void* dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(mp_smem(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void mp_copy4(void* dst, const void* src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(mp_smem(dst)), "l"(src) : "memory");
}

template <bool SWIGLU>
__device__ void moe_pipe(float* out, const float* x, int x_div, const int* sorted, const int* tile_expert,
                         const int* num_tiles, const u64* w1, const u64* w2, int N, int K, float limit) {
    constexpr int MATS = SWIGLU ? 2 : 1;
    extern __shared__ __align__(16) unsigned char mp_raw[];
    __shared__ int rows[MP_BM];
    float* xs = (float*)mp_raw;                         // [2][MP_BM][MP_XS]
    u8* ws = mp_raw + 2 * MP_BM * MP_XS * 4;            // [2][MATS · MP_BN][MP_WROW]
    int tile = blockIdx.y, nblk = blockIdx.x;
    if (tile >= *num_tiles) return;
    int e = tile_expert[tile];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    int wm = warp >> 2, wn = warp & 3;
    if (threadIdx.x < MP_BM) rows[threadIdx.x] = sorted[tile * MP_BM + threadIdx.x];
    __syncthreads();
    long long rb = (long long)(K / 32) * 17;
    const u8* wgate = (const u8*)w1[e];
    const u8* wup = (const u8*)(SWIGLU ? w2[e] : w1[e]);
    int chunks = K / MP_KC;
    // Chunk c into stage s: a tile row without a pair is left as it is (its products land
    // in no output); features past N read row 0 (valid; their sums are not stored).
    auto load = [&](int c, int s) {
        int k0 = c * MP_KC;
        float* xd = xs + s * MP_BM * MP_XS;
        for (int i = threadIdx.x; i < MP_BM * MP_KC / 4; i += MP_THREADS) {
            int r = i / (MP_KC / 4), c4 = i % (MP_KC / 4), p = rows[r];
            if (p >= 0) mp_copy16(xd + r * MP_XS + 4 * c4, x + (long long)(p / x_div) * K + k0 + 4 * c4);
        }
        u8* wd = ws + s * MATS * MP_BN * MP_WROW;
        for (int i = threadIdx.x; i < MATS * MP_BN * (MP_WROW / 4); i += MP_THREADS) {
            int row = i / (MP_WROW / 4), w4 = i % (MP_WROW / 4);
            int f = nblk * MP_BN + row % MP_BN;
            f = f < N ? f : 0;
            const u8* wm0 = row < MP_BN ? wgate : wup;
            mp_copy4(wd + row * MP_WROW + 4 * w4, wm0 + f * rb + (long long)(k0 / 32) * 17 + 4 * w4);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    float acc[MATS][2][4][4];
#pragma unroll
    for (int s = 0; s < MATS; ++s)
#pragma unroll
        for (int m = 0; m < 2; ++m)
#pragma unroll
            for (int j = 0; j < 4; ++j) acc[s][m][j][0] = acc[s][m][j][1] = acc[s][m][j][2] = acc[s][m][j][3] = 0.0f;
    load(0, 0);
    for (int c = 0; c < chunks; ++c) {
        if (c + 1 < chunks) {
            load(c + 1, (c + 1) & 1);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        __syncthreads();
        const float* xc = xs + (c & 1) * MP_BM * MP_XS;
        const u8* wc = ws + (c & 1) * MATS * MP_BN * MP_WROW;
#pragma unroll 1
        for (int b = 0; b < MP_KC / 32; ++b) {
            // A: rows g and g + 8 of each 16-row tile, columns 8q .. 8q + 7 of the block.
            u32 a[2][2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int h = 0; h < 2; ++h) {
                    const float* src = xc + (32 * wm + 16 * m + g + 8 * h) * MP_XS + 32 * b + 8 * q;
                    float4 p0 = *(const float4*)src, p1 = *(const float4*)(src + 4);
                    // (step 0: a0/a1 then a2/a3, step 1 likewise): h picks row g or g + 8.
                    a[m][0][h] = tile_bf16x2(p0.x, p0.y);
                    a[m][0][2 + h] = tile_bf16x2(p0.z, p0.w);
                    a[m][1][h] = tile_bf16x2(p1.x, p1.y);
                    a[m][1][2 + h] = tile_bf16x2(p1.z, p1.w);
                }
#pragma unroll
            for (int s = 0; s < MATS; ++s)
#pragma unroll
                for (int j = 0; j < 4; ++j) {
                    const u8* blk = wc + (s * MP_BN + 32 * wn + 8 * j + g) * MP_WROW + 17 * b;
                    u32 ex = blk[0];
                    u32 scale = ex != 0 ? ex << 7 : 0x40u;  // 2^(e−127) as bf16; 0: subnormal
                    scale |= scale << 16;
                    // The 4 code bytes from the aligned words around them (a row's 68 bytes
                    // start 4-aligned): 2 shared loads, not 4; the second only when they
                    // straddle (never past the row: at offset 64 they are word-aligned).
                    int o = 17 * b + 1 + 4 * q, sh = 8 * (o & 3);
                    const u32* wd = (const u32*)(wc + (s * MP_BN + 32 * wn + 8 * j + g) * MP_WROW + (o & ~3));
                    u32 codes = sh ? __funnelshift_r(wd[0], wd[1], sh) : wd[0];
                    u32 w[4];
                    tile_e2m1x4(codes & 0xffffu, scale, w[0], w[1]);
                    tile_e2m1x4(codes >> 16, scale, w[2], w[3]);
#pragma unroll
                    for (int m = 0; m < 2; ++m) {
                        mma_bf16(acc[s][m][j], a[m][0][0], a[m][0][1], a[m][0][2], a[m][0][3], w[0], w[1]);
                        mma_bf16(acc[s][m][j], a[m][1][0], a[m][1][1], a[m][1][2], a[m][1][3], w[2], w[3]);
                    }
                }
        }
        __syncthreads();  // this stage is read: the next iteration's copies may overwrite it
    }
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int p = rows[32 * wm + 16 * m + g + 8 * h];
            if (p < 0) continue;
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int cc = 0; cc < 2; ++cc) {
                    int f = nblk * MP_BN + 32 * wn + 8 * j + 2 * q + cc;
                    if (f >= N) continue;
                    float v = acc[0][m][j][2 * h + cc];
                    if (SWIGLU) v = tile_swiglu(v, acc[MATS - 1][m][j][2 * h + cc], limit);
                    out[(long long)p * N + f] = v;
                }
        }
}

#define MOE_PIPE_ENTRY(name, SWIGLU)                                                              \
    extern "C" __global__ void __launch_bounds__(MP_THREADS, 2) name(                             \
        float* out, const float* x, int x_div, const int* sorted, const int* tile_expert,        \
        const int* num_tiles, const u64* w1, const u64* w2, int N, int K, float limit) {          \
        moe_pipe<SWIGLU>(out, x, x_div, sorted, tile_expert, num_tiles, w1, w2, N, K, limit);   \
    }
MOE_PIPE_ENTRY(dsv4_moe_up_mxfp4_pipe_kernel, true)
MOE_PIPE_ENTRY(dsv4_moe_down_mxfp4_pipe_kernel, false)
