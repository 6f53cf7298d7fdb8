// Many rows a tile of MXFP4 experts (a prefill's routed pairs): a pipelined grouped GEMM
// (appended after moe.cu; `mma_bf16`, `tile_e2m1x4`, `tile_swiglu` from mma_tile.cu). The
// first form of this kernel (8 warps over 64 rows, each warp decoding the E2M1 codes it
// multiplied) ran at ~83 TFLOP/s, bound by issue: every weight was decoded twice a tile,
// at ~3.5 instructions a value, for 2 mmas. Here a block of 16 warps takes 128 rows, so a
// decoded weight serves 128 rows: each thread decodes one 32-column block of one weight
// row a K chunk into shared memory as bf16, and the warps (4 along the rows × 4 along the
// weight rows, 32 × 32 each) read both operands with ldmatrix. K goes in chunks of MP_KC
// through three stages that cp.async fills (the rows, already bf16, 16 bytes a copy; the
// weights as stored, each row's 4 blocks of 17 bytes, 4-byte aligned at this chunk size)
// and two buffers of decoded weights, so one barrier a chunk: after it, chunk c + 2's
// copies go out, chunk c + 1 is decoded and chunk c's products run. The up pass's weight
// rows interleave gate and up by 16 so that a lane holds both sums of its features and
// writes SwiGLU's result, as bf16 (the down pass's operand). K a multiple of MP_KC; 512
// threads; dynamic shared memory MP_SMEM_BYTES.
#define MP_BM 128
#define MP_BR 128  // weight rows a block: 64 features × (gate, up), or 128 features
#define MP_KC 128
#define MP_STRIDE (MP_KC + 8)  // bf16 row stride: ldmatrix's 8 rows in distinct banks
#define MP_WROW 68             // a weight row's bytes in a chunk: 4 MXFP4 blocks
#define MP_STAGES 3
#define MP_THREADS 512
#define MP_A_BYTES (MP_BM * MP_STRIDE * 2)
#define MP_W_BYTES (MP_BR * MP_STRIDE * 2)
#define MP_RAW_BYTES (MP_BR * MP_WROW)
#define MP_SMEM_BYTES (MP_STAGES * (MP_A_BYTES + MP_RAW_BYTES) + 2 * MP_W_BYTES)

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
__device__ __forceinline__ void mp_ldsm4(u32 addr, u32* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}

template <bool SWIGLU>
__device__ void moe_pipe(void* out, const u16* x, int x_div, const int* sorted, const int* tile_expert,
                         const int* num_tiles, const u64* w1, const u64* w2, int N, int K, float limit) {
    extern __shared__ __align__(16) unsigned char mp_raw[];
    __shared__ int rows[MP_BM];
    unsigned char* a_s = mp_raw;                                // [STAGES][BM][STRIDE] bf16
    unsigned char* raw_s = a_s + MP_STAGES * MP_A_BYTES;        // [STAGES][BR][WROW]
    unsigned char* w_s = raw_s + MP_STAGES * MP_RAW_BYTES;      // [2][BR][STRIDE] bf16
    int tile = blockIdx.y;
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
    // Chunk c into stage c % 3: a tile row without a pair is left as it is (its products
    // land in no output); weight rows past N read row 0 (valid; their sums are not stored).
    auto load = [&](int c) {
        int k0 = c * MP_KC, s = c % MP_STAGES;
        unsigned char* ad = a_s + s * MP_A_BYTES;
        for (int i = threadIdx.x; i < MP_BM * (MP_KC / 8); i += MP_THREADS) {
            int r = i / (MP_KC / 8), seg = i % (MP_KC / 8), p = rows[r];
            if (p >= 0) mp_copy16(ad + (r * MP_STRIDE + 8 * seg) * 2, x + (long long)(p / x_div) * K + k0 + 8 * seg);
        }
        unsigned char* rd = raw_s + s * MP_RAW_BYTES;
        for (int i = threadIdx.x; i < MP_BR * (MP_WROW / 4); i += MP_THREADS) {
            int r = i / (MP_WROW / 4), w4 = i % (MP_WROW / 4);
            int f = SWIGLU ? blockIdx.x * (MP_BR / 2) + 16 * (r >> 5) + (r & 15) : blockIdx.x * MP_BR + r;
            const u8* m = SWIGLU && (r & 16) ? wup : wgate;
            f = f < N ? f : 0;
            mp_copy4(rd + r * MP_WROW + 4 * w4, m + f * rb + (long long)(k0 / 32) * 17 + 4 * w4);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    // This thread's block of a chunk: weight row dr, columns 32·db .. 32·db + 31, decoded
    // into the chunk's buffer of bf16 weights.
    // (Rows 17 words apart: a quarter-warp's 8 rows load and store in distinct banks.)
    int dr = threadIdx.x & (MP_BR - 1), db = threadIdx.x / MP_BR;
    auto decode = [&](int c) {
        const unsigned char* src = raw_s + (c % MP_STAGES) * MP_RAW_BYTES + dr * MP_WROW;
        u32 ex = src[17 * db];
        u32 scale = ex != 0 ? ex << 7 : 0x40u;  // 2^(e−127) as bf16; 0: subnormal
        scale |= scale << 16;
        // The 16 code bytes from the aligned words around them (a row's 68 bytes start
        // 4-aligned; the fifth word only when they straddle, never past the row).
        int o = 17 * db + 1, sh = 8 * (o & 3);
        const u32* wd = (const u32*)(src + (o & ~3));
        u32 v[5] = {wd[0], wd[1], wd[2], wd[3], sh ? wd[4] : 0u};
        uint4* dst = (uint4*)(w_s + (c & 1) * MP_W_BYTES + (dr * MP_STRIDE + 32 * db) * 2);
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            u32 codes = __funnelshift_r(v[i], v[i + 1], sh), w[4];
            tile_e2m1x4(codes & 0xffffu, scale, w[0], w[1]);
            tile_e2m1x4(codes >> 16, scale, w[2], w[3]);
            dst[i] = make_uint4(w[0], w[1], w[2], w[3]);
        }
    };
    float acc[2][4][4];
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[m][j][0] = acc[m][j][1] = acc[m][j][2] = acc[m][j][3] = 0.0f;
    // ldmatrix's row addresses: A's lanes 0–15 rows 0–15 at k, 16–31 the same at k + 8;
    // B's (two 8-row tiles an x4) lanes 0–7 tile 0 at k, 8–15 tile 0 at k + 8, then tile 1.
    u32 a_at = ((32 * wm + (lane & 15)) * MP_STRIDE + 8 * (lane >> 4)) * 2;
    u32 b_at = ((32 * wn + (lane & 7) + 8 * (lane >> 4)) * MP_STRIDE + 8 * ((lane >> 3) & 1)) * 2;
    load(0);
    if (chunks > 1) {
        load(1);
        asm volatile("cp.async.wait_group 1;" ::: "memory");
    } else {
        asm volatile("cp.async.wait_group 0;" ::: "memory");
    }
    __syncthreads();
    decode(0);
    for (int c = 0; c < chunks; ++c) {
        // Chunk c + 1's copies have landed, chunk c's weights are decoded, and every warp
        // is done with chunk c − 1's stage and buffer.
        asm volatile("cp.async.wait_group 0;" ::: "memory");
        __syncthreads();
        if (c + 2 < chunks) load(c + 2);
        if (c + 1 < chunks) decode(c + 1);
        u32 ac = mp_smem(a_s + (c % MP_STAGES) * MP_A_BYTES) + a_at;
        u32 wc = mp_smem(w_s + (c & 1) * MP_W_BYTES) + b_at;
#pragma unroll
        for (int kk = 0; kk < MP_KC / 16; ++kk) {
            u32 a[2][4], b[2][4];
#pragma unroll
            for (int m = 0; m < 2; ++m) mp_ldsm4(ac + (16 * m * MP_STRIDE + 16 * kk) * 2, a[m]);
#pragma unroll
            for (int t = 0; t < 2; ++t) mp_ldsm4(wc + (16 * t * MP_STRIDE + 16 * kk) * 2, b[t]);
#pragma unroll
            for (int m = 0; m < 2; ++m)
#pragma unroll
                for (int j = 0; j < 4; ++j)
                    mma_bf16(acc[m][j], a[m][0], a[m][1], a[m][2], a[m][3], b[j >> 1][2 * (j & 1)],
                             b[j >> 1][2 * (j & 1) + 1]);
        }
    }
#pragma unroll
    for (int m = 0; m < 2; ++m)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            int p = rows[32 * wm + 16 * m + g + 8 * h];
            if (p < 0) continue;
#pragma unroll
            for (int j = 0; j < (SWIGLU ? 2 : 4); ++j) {
                // Up: tiles 0–1 are the gate rows of features 16·wn .. 16·wn + 15, tiles
                // 2–3 their up rows. A lane's two features are adjacent (N is even).
                int f = SWIGLU ? blockIdx.x * (MP_BR / 2) + 16 * wn + 8 * j + 2 * q
                               : blockIdx.x * MP_BR + 32 * wn + 8 * j + 2 * q;
                if (f >= N) continue;
                const float* a = acc[m][j] + 2 * h;
                if (SWIGLU) {
                    const float* u = acc[m][j + 2] + 2 * h;
                    *(u32*)((u16*)out + (long long)p * N + f) =
                        tile_bf16x2(tile_swiglu(a[0], u[0], limit), tile_swiglu(a[1], u[1], limit));
                } else {
                    *(float2*)((float*)out + (long long)p * N + f) = make_float2(a[0], a[1]);
                }
            }
        }
}

#define MOE_PIPE_ENTRY(name, SWIGLU)                                                              \
    extern "C" __global__ void __launch_bounds__(MP_THREADS, 1) name(                             \
        void* out, const u16* x, int x_div, const int* sorted, const int* tile_expert,        \
        const int* num_tiles, const u64* w1, const u64* w2, int N, int K, float limit) {          \
        moe_pipe<SWIGLU>(out, x, x_div, sorted, tile_expert, num_tiles, w1, w2, N, K, limit);   \
    }
MOE_PIPE_ENTRY(dsv4_moe_up_mxfp4_pipe_kernel, true)
MOE_PIPE_ENTRY(dsv4_moe_down_mxfp4_pipe_kernel, false)
