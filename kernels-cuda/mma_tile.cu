// Tiles of rows times a weight matrix on the tensor cores (mma.m16n8k16, bf16 in, f32
// accumulate), the weights read as stored — bf16, or MXFP4 dequantized in registers.
// Shared by DeepSeek-V4's grouped experts (`moe.cu`: a tile's rows are pairs routed to one
// expert, found through a table of weight addresses) and the batch-invariant dense GEMM
// (`invariant_mma.cu`: rows in order, one matrix).
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned long long u64;
typedef unsigned int u32;

#define TILE_BF16 0
#define TILE_MXFP4 1

// D = A·B + D on tensor cores: A 16×16 bf16 (row-major fragments), B 16×8 bf16, f32 D.
// (Also the attention kernels' mma, which follow this file in the Llama program.)
__device__ __forceinline__ void mma_bf16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0,
                                         u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// (lo, hi) → bf16x2 with `lo` in the low half, rounded to nearest.
__device__ __forceinline__ u32 tile_bf16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float tile_bf16_lo(u32 v) { return __int_as_float(v << 16); }
__device__ __forceinline__ float tile_bf16_hi(u32 v) { return __int_as_float(v & 0xffff0000u); }

// Four E2M1 codes (a 16-bit run of nibbles, value 0 lowest) as two bf16x2 words times
// `scale2` (the block's 2^(e−127) in both halves; exact, a power of two). The magnitudes'
// bf16 bytes come from two byte tables by `prmt` (0, .5, 1, 1.5, 2, 3, 4, 6), the sign is
// bit 3 of each code.
__device__ __forceinline__ void tile_e2m1x4(u32 codes, u32 scale2, u32& w01, u32& w23) {
    u32 sel = codes & 0x7777u, lo, hi;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(lo) : "r"(0xC0800000u), "r"(0xC0804000u), "r"(sel));
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(hi) : "r"(0x3F3F3F00u), "r"(0x40404040u), "r"(sel));
    u32 a, b;
    asm("prmt.b32 %0, %1, %2, 0x5140;" : "=r"(a) : "r"(lo), "r"(hi));
    asm("prmt.b32 %0, %1, %2, 0x7362;" : "=r"(b) : "r"(lo), "r"(hi));
    u32 s = codes & 0x8888u;
    a |= ((s & 0x8u) << 12) | ((s & 0x80u) << 24);
    b |= ((s & 0x800u) << 4) | ((s & 0x8000u) << 16);
    // −0 as the addend: a product's own sign survives, zeros included.
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(w01) : "r"(a), "r"(scale2), "r"(0x80008000u));
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(w23) : "r"(b), "r"(scale2), "r"(0x80008000u));
}

// An MXFP4 block's bytes this lane needs, as loaded (`tile_raw_b`) and then decoded
// (`tile_decode_b`): the exponent, and the 4 code bytes of quad position q — tile_load_b in
// two halves, so that a block's loads can be issued a step before its products (the
// one-step form keeps the few-row kernels' registers as they were).
struct TileRaw {
    u32 e, codes;
};
__device__ __forceinline__ TileRaw tile_raw_b(const u8* row, int k, int K, int q) {
    if (k >= K) return TileRaw{0x100u, 0};  // past K: zero weights
    const u8* b = row + (long long)(k / 32) * 17;
    return TileRaw{b[0], (u32)b[1 + 4 * q] | ((u32)b[2 + 4 * q] << 8) | ((u32)b[3 + 4 * q] << 16) |
                             ((u32)b[4 + 4 * q] << 24)};
}
__device__ __forceinline__ void tile_decode_b(TileRaw r, u32* w) {
    if (r.e == 0x100u) {
        w[0] = w[1] = w[2] = w[3] = 0;
        return;
    }
    u32 s = r.e != 0 ? r.e << 7 : 0x40u;  // 2^(e−127) as bf16; e = 0 is a subnormal
    s |= s << 16;
    tile_e2m1x4(r.codes & 0xffffu, s, w[0], w[1]);
    tile_e2m1x4(r.codes >> 16, s, w[2], w[3]);
}

// The B fragments of one weight row (feature) for the 32 columns from `k`: this lane's
// quad position q takes the row's columns 8q .. 8q + 7 of the block, as (step 0: b0, b1,
// step 1: b0, b1). The mma's k order inside the block is thus a permutation of the
// columns; the A fragments (`tile_gemm`) take the same one. Zero past K.
template <int FMT>
__device__ __forceinline__ void tile_load_b(const u8* row, int k, int K, int q, u32* w) {
    if (FMT == TILE_BF16) {
        if (k + 8 * q < K) {
            uint4 v = *(const uint4*)(row + 2ll * (k + 8 * q));
            w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
        } else {
            w[0] = w[1] = w[2] = w[3] = 0;
        }
    } else if (k >= K) {
        w[0] = w[1] = w[2] = w[3] = 0;
    } else {
        // 17-byte blocks (packed.cu's TROUPE_MXFP4): the exponent, then value pairs.
        const u8* b = row + (long long)(k / 32) * 17;
        u32 e = b[0];
        u32 s = e != 0 ? e << 7 : 0x40u;  // 2^(e−127) as bf16; e = 0 is a subnormal
        s |= s << 16;
        u32 codes = (u32)b[1 + 4 * q] | ((u32)b[2 + 4 * q] << 8) | ((u32)b[3 + 4 * q] << 16) |
                    ((u32)b[4 + 4 * q] << 24);
        tile_e2m1x4(codes & 0xffffu, s, w[0], w[1]);
        tile_e2m1x4(codes >> 16, s, w[2], w[3]);
    }
}

__device__ __forceinline__ long long tile_row_bytes(int fmt, int K) {
    return fmt == TILE_BF16 ? 2ll * K : (long long)(K / 32) * 17;
}

// The clipped SwiGLU of a gate and an up sum: silu(min(g, limit)) · clamp(u, ±limit).
__device__ __forceinline__ float tile_swiglu(float g, float u, float limit) {
    float gv = fminf(g, limit);
    return gv * (1.0f / (1.0f + expf(-gv))) * fminf(fmaxf(u, -limit), limit);
}

// One tile of BM = 16·MT rows against BN output features of its expert. Four warps: along
// N (KSPLIT 1) or splitting each 32-column block of K four ways (KSPLIT 4, for few rows:
// more blocks, the same weights read once). The split's partial sums are added in warp
// order, so a row's result depends only on the kernel's shape, never on the other rows.
// x rows (`x_div` pairs a row: k for the token's input, 1 for the pair's own) are staged
// as bf16 in shared memory, with their bf16 remainder when HILO (f32 accuracy at twice the
// mma work). SWIGLU: w1 = gate, w2 = up, out = silu(min(g, limit)) · clamp(u, ±limit).
// Grouped: a tile's rows are `sorted[tile·BM ..]` (−1: none), its weights `w1[e]` (and
// `w2[e]`) for e = `tile_expert[tile]`. Dense (`sorted` null): rows tile·BM .. below M,
// `w1` the weights themselves, grid x the row tiles and y the feature blocks.
template <int MT, int NT, int KSPLIT, int FMT, bool SWIGLU, bool HILO>
__device__ void tile_gemm(float* out, const float* x, int x_div, const int* sorted,
                          const int* tile_expert, const int* num_tiles, const u64* w1,
                          const u64* w2, int M, int N, int K, float limit) {
    constexpr int BM = 16 * MT, NW = 4 / KSPLIT, BN = 8 * NT * NW;
    constexpr int KC = 8192 / BM, LDS = KC + 8;
    // Few rows: all of a chunk's blocks of this warp at once; many: one at a time (the
    // accumulators already fill the registers).
    constexpr int PF = MT == 1 ? KC / 32 / KSPLIT : 1;
    constexpr int MATS = SWIGLU ? 2 : 1, PARTS = HILO ? 2 : 1;
    __shared__ __align__(16) u16 xs[PARTS][BM * LDS];
    __shared__ int rows[BM];
    __shared__ float red[KSPLIT > 1 ? KSPLIT - 1 : 1][KSPLIT > 1 ? MATS * MT * NT * 4 : 1][32];
    // MXFP4 with few rows: a chunk's weights (16 blocks of 17 bytes a feature, 16-byte
    // aligned runs when K is a multiple of 512) come in through shared memory by 16-byte
    // loads; a lane's own 17-byte-strided byte loads kept the L1 busy at 0.3 TB/s.
    constexpr bool STAGE = FMT == TILE_MXFP4 && MT == 1 && KC == 512;
    constexpr int WV = 17, W_TOTAL = STAGE ? MATS * BN * WV : 1, W_PER = (W_TOTAL + 127) / 128;
    __shared__ uint4 ws[W_TOTAL];
    bool dense = sorted == nullptr;
    // Dense launches put the row tiles on x, so the tiles reading the same weights run
    // together and share them through L2.
    int tile = dense ? blockIdx.x : blockIdx.y, nblk = dense ? blockIdx.y : blockIdx.x;
    if (!dense && tile >= *num_tiles) return;
    int e = dense ? 0 : tile_expert[tile];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    int nw = warp % NW, kw = warp / NW;
    if (threadIdx.x < BM) {
        int r = tile * BM + threadIdx.x;
        rows[threadIdx.x] = dense ? (r < M ? r : -1) : sorted[r];
    }
    long long rb = tile_row_bytes(FMT, K);
    bool staged = STAGE && K % 512 == 0;
    const u8* wbase[2] = {dense ? (const u8*)w1 : (const u8*)w1[e], SWIGLU ? (const u8*)w2[e] : nullptr};
    const u8* wrow[MATS][NT];
    int n0 = nblk * BN + nw * 8 * NT;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        int f = n0 + 8 * j + g;
        f = f < N ? f : 0;  // past the end: a valid row, its outputs unused
#pragma unroll
        for (int m = 0; m < MATS; ++m)
            wrow[m][j] = staged ? (const u8*)&ws[(m * BN + nw * 8 * NT + 8 * j + g) * WV]
                                : wbase[m] + f * rb;
    }
    float acc[MATS][MT][NT][4];
#pragma unroll
    for (int s = 0; s < MATS; ++s)
#pragma unroll
        for (int m = 0; m < MT; ++m)
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int c = 0; c < 4; ++c) acc[s][m][j][c] = 0.0f;
    __syncthreads();
    for (int k0 = 0; k0 < K; k0 += KC) {
        uint4 wv[W_PER];
        if (STAGE && staged) {
#pragma unroll
            for (int u = 0; u < W_PER; ++u) {
                int i = threadIdx.x + u * 128;
                if (i >= W_TOTAL) break;
                int m = i / (BN * WV), f = i / WV % BN, v = i % WV;
                int feat = nblk * BN + f;
                feat = feat < N ? feat : 0;
                wv[u] = ((const uint4*)(wbase[m] + feat * rb + (k0 / 32) * 17))[v];
            }
        }
        __syncthreads();  // the last chunk is consumed
        for (int i = threadIdx.x * 4; i < BM * KC; i += 128 * 4) {
            int r = i / KC, c = i % KC, kk = k0 + c, p = rows[r];
            // A row without a pair is left as it is: its products land in no output.
            if (p < 0) continue;
            float4 v = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
            if (kk < K) v = *(const float4*)(x + (long long)(p / x_div) * K + kk);
            u32 h0 = tile_bf16x2(v.x, v.y), h1 = tile_bf16x2(v.z, v.w);
            *(uint2*)&xs[0][r * LDS + c] = make_uint2(h0, h1);
            if (HILO) {
                u32 l0 = tile_bf16x2(v.x - tile_bf16_lo(h0), v.y - tile_bf16_hi(h0));
                u32 l1 = tile_bf16x2(v.z - tile_bf16_lo(h1), v.w - tile_bf16_hi(h1));
                *(uint2*)&xs[PARTS - 1][r * LDS + c] = make_uint2(l0, l1);
            }
        }
        if (STAGE && staged) {
#pragma unroll
            for (int u = 0; u < W_PER; ++u) {
                int i = threadIdx.x + u * 128;
                if (i >= W_TOTAL) break;
                ws[i] = wv[u];
            }
        }
        __syncthreads();
        int kend = min(KC, K - k0);
        // Many rows, MXFP4 read directly: the next block's bytes are loaded while this one's
        // products run (its loads, byte-wise at a 17-byte stride, would otherwise each wait
        // out a round trip before the mma they feed).
        constexpr bool AHEAD = FMT == TILE_MXFP4 && PF == 1 && MT > 1;
        TileRaw next[AHEAD ? MATS : 1][AHEAD ? NT : 1];
        if (AHEAD && !staged) {
#pragma unroll
            for (int s = 0; s < MATS; ++s)
#pragma unroll
                for (int j = 0; j < NT; ++j) {
                    int kb = kw * 32;
                    next[s][j] = tile_raw_b(wrow[s][j], kb < kend ? k0 + kb : K, K, q);
                }
        }
        // PF of this warp's 32-column blocks are loaded before their products: with few rows
        // the weights are the whole cost, and these loads are what is in flight.
#pragma unroll 1
        for (int kb0 = kw * 32; kb0 < kend; kb0 += 32 * KSPLIT * PF) {
            u32 b[PF][MATS][NT][4];
            if (AHEAD && !staged) {
#pragma unroll
                for (int s = 0; s < MATS; ++s)
#pragma unroll
                    for (int j = 0; j < NT; ++j) {
                        tile_decode_b(next[s][j], b[0][s][j]);
                        int kb = kb0 + 32 * KSPLIT;
                        next[s][j] = tile_raw_b(wrow[s][j], kb < kend ? k0 + kb : K, K, q);
                    }
            } else {
#pragma unroll
                for (int i = 0; i < PF; ++i)
#pragma unroll
                    for (int s = 0; s < MATS; ++s)
#pragma unroll
                        for (int j = 0; j < NT; ++j) {
                            int kb = kb0 + i * 32 * KSPLIT;
                            // Staged rows start at the chunk; direct ones at column 0.
                            int k = staged ? (kb < kend ? kb : KC) : (kb < kend ? k0 + kb : K);
                            tile_load_b<FMT>(wrow[s][j], k, staged ? KC : K, q, b[i][s][j]);
                        }
            }
#pragma unroll
            for (int i = 0; i < PF; ++i) {
                int kb = kb0 + i * 32 * KSPLIT;
                if (kb >= kend) break;
#pragma unroll
                for (int part = 0; part < PARTS; ++part)
#pragma unroll
                    for (int m = 0; m < MT; ++m) {
                        const u16* base = &xs[part][(16 * m + g) * LDS + kb + 8 * q];
                        uint4 ra = *(const uint4*)base, rb8 = *(const uint4*)(base + 8 * LDS);
#pragma unroll
                        for (int s = 0; s < MATS; ++s)
#pragma unroll
                            for (int j = 0; j < NT; ++j) {
                                const u32* w = b[i][s][j];
                                mma_bf16(acc[s][m][j], ra.x, rb8.x, ra.y, rb8.y, w[0], w[1]);
                                mma_bf16(acc[s][m][j], ra.z, rb8.z, ra.w, rb8.w, w[2], w[3]);
                            }
                    }
            }
        }
    }
    if (KSPLIT > 1) {
        if (kw > 0) {
            int i = 0;
#pragma unroll
            for (int s = 0; s < MATS; ++s)
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int c = 0; c < 4; ++c) red[kw - 1][i++][lane] = acc[s][m][j][c];
        }
        __syncthreads();
        if (kw > 0) return;
#pragma unroll
        for (int w = 0; w < KSPLIT - 1; ++w) {
            int i = 0;
#pragma unroll
            for (int s = 0; s < MATS; ++s)
#pragma unroll
                for (int m = 0; m < MT; ++m)
#pragma unroll
                    for (int j = 0; j < NT; ++j)
#pragma unroll
                        for (int c = 0; c < 4; ++c) acc[s][m][j][c] += red[w][i++][lane];
        }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            int p = rows[16 * m + g + 8 * half];
            if (p < 0) continue;
#pragma unroll
            for (int j = 0; j < NT; ++j)
#pragma unroll
                for (int c = 0; c < 2; ++c) {
                    int f = n0 + 8 * j + 2 * q + c;
                    if (f >= N) continue;
                    float v = acc[0][m][j][2 * half + c];
                    if (SWIGLU) v = tile_swiglu(v, acc[MATS - 1][m][j][2 * half + c], limit);
                    out[(long long)p * N + f] = v;
                }
        }
}

