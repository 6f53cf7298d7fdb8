// The Q4_K GEMV on tensor cores, for up to 8 rows of x staged in shared memory (appended
// after fp8_mma.cu, whose staging and fragments it shares). Q4_K rows are 144-byte blocks
// of 256 weights: f16 d and dmin, 12 bytes of 6-bit sub-block scales and mins, 128 bytes
// of nibbles (byte j of 32-byte chunk c: element 64c + j in its low nibble, 64c + 32 + j in
// its high one). A warp takes 16 rows; a thread 16 bytes of nibbles of row g and of row
// g + 8 a step (32 weights each: 16 of the low sub-block, 16 of the high one) and turns
// them into f16 weights w = n · d·scale − dmin·min in registers (magic-number nibble
// conversion, exact, then one rounding for the scale), so each step is eight mmas with no
// scale left to apply after them. f16 weights round at 2^-11, finer than the bf16 the
// wide batches' GEMMs dequantize to.

// f16x2 arithmetic on raw registers (NVRTC builds without cuda_fp16.h here).
__device__ __forceinline__ u32 hsub2(u32 a, u32 b) {
    u32 d;
    asm("sub.rn.f16x2 %0, %1, %2;" : "=r"(d) : "r"(a), "r"(b));
    return d;
}
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}

// Sub-block s's scale · d and min · dmin from a block's first 16 bytes.
__device__ __forceinline__ void q4k_scale_min(uint4 hdr, int s, u32& scale2, u32& neg_min2) {
    u32 words[3] = {hdr.y, hdr.z, hdr.w};
    auto byte = [&](int i) { return (int)((words[i >> 2] >> (8 * (i & 3))) & 0xffu); };
    int sc, mn;
    if (s < 4) {
        sc = byte(s) & 63;
        mn = byte(s + 4) & 63;
    } else {
        sc = (byte(s + 4) & 0xF) | ((byte(s - 4) >> 6) << 4);
        mn = (byte(s + 4) >> 4) | ((byte(s) >> 6) << 4);
    }
    float d = f16_bits_to_f32((unsigned short)(hdr.x & 0xffffu));
    float dmin = f16_bits_to_f32((unsigned short)(hdr.x >> 16));
    float a = d * (float)sc, b = -dmin * (float)mn;
    scale2 = f32x2_to_f16x2(a, a);
    neg_min2 = f32x2_to_f16x2(b, b);
}

// One word of nibbles (bytes 0..3) as four f16x2 weights: low nibbles of bytes (0, 2) and
// (1, 3) with the low sub-block's scale and min, high nibbles likewise with the high one's.
// 0x6400 | n is the f16 1024 + n, 0x6400 | 16n is 1024 + 16n: both exact, and subtracting
// (or scaling by 1/16 and subtracting 64) leaves n exactly.
__device__ __forceinline__ void q4k_word(u32 q, u32 sl, u32 ml, u32 sh, u32 mh, u32 out[4]) {
    const u32 EX = 0x64006400u, K1024 = 0x64006400u, SIXTEENTH = 0x2C002C00u,
              MINUS64 = 0xD400D400u;
    u32 q8 = q >> 8;
    u32 l02 = hsub2((q & 0x000f000fu) | EX, K1024), l13 = hsub2((q8 & 0x000f000fu) | EX, K1024);
    u32 h02 = hfma2((q & 0x00f000f0u) | EX, SIXTEENTH, MINUS64);
    u32 h13 = hfma2((q8 & 0x00f000f0u) | EX, SIXTEENTH, MINUS64);
    out[0] = hfma2(l02, sl, ml);
    out[1] = hfma2(l13, sl, ml);
    out[2] = hfma2(h02, sh, mh);
    out[3] = hfma2(h13, sh, mh);
}

#define Q4K_DEPTH 4
// x was staged times 2^-4 (TC_X_SCALE); the weights are their own values.
#define Q4K_UNSCALE 16.0f

// acc += one m16n8k16 step: weight rows g (ra) and g + 8 (rb), the low (hi 0) or high
// (hi 1) half of their f16x2 words, against the x fragment of x row g. Logical columns
// 2t, 2t+1: a word's bytes 0 and 2; 2t+8, 2t+9: bytes 1 and 3.
__device__ __forceinline__ void mma_rows16(float acc[4], const u32 ra[4], const u32 rb[4], int hi,
                                           uint2 xf) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
        : "r"(ra[2 * hi]), "r"(rb[2 * hi]), "r"(ra[2 * hi + 1]), "r"(rb[2 * hi + 1]), "r"(xf.y),
          "r"(xf.x));
}

// A block's 16 weight rows × up to 8 x rows, summed over its warps, into y (unscaled).
// acc0, acc1: weight row g, x rows 2t and 2t + 1; acc2, acc3: weight row g + 8.
__device__ __forceinline__ void store_rows16(float (*partial)[16][8], const float acc[4], float* y,
                                             int ldy, long long n0, int m, int N) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    partial[warp][g][2 * t] = acc[0];
    partial[warp][g][2 * t + 1] = acc[1];
    partial[warp][g + 8][2 * t] = acc[2];
    partial[warp][g + 8][2 * t + 1] = acc[3];
    __syncthreads();
    if (threadIdx.x < 128) {
        int row = threadIdx.x >> 3, i = threadIdx.x & 7;  // 16 rows × 8 x rows
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < TC_WARPS; ++w) v += partial[w][row][i];
        long long n = n0 + row;
        if (i < m && n < N) y[(long long)i * ldy + n] = v * Q4K_UNSCALE;
    }
}

extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, 2)
    gemv_q4k_mma_kernel(float* y, int ldy, const float* x, const u8* W, int m, int N, int K) {
    constexpr int STEP_K = 128;  // a warp's 16 rows × 4 threads × 32 weights
    __shared__ float partial[TC_WARPS][16][8];
    extern __shared__ uint2 xs[];  // x[i][k / 4] as x_fragment: (x1, x3) then (x0, x2)
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    long long n0 = (long long)blockIdx.x * 16;
    long long r0 = n0 + g < N ? n0 + g : n0, r1 = n0 + g + 8 < N ? n0 + g + 8 : n0;
    long long row_bytes = (long long)(K / 256) * 144;
    const u8* w0 = W + r0 * row_bytes;
    const u8* w1 = W + r1 * row_bytes;
    int steps = K / STEP_K, c = t >> 1, half = t & 1;
    bool has_x = g < m;
    // Step st: block st / 2, chunk 2 · (st % 2) + t / 2, half t % 2 of it.
    auto qs_at = [&](int st) { return (st >> 1) * 144 + 16 + 32 * (2 * (st & 1) + c) + 16 * half; };
    uint4 h0[Q4K_DEPTH], h1[Q4K_DEPTH], p0[Q4K_DEPTH], p1[Q4K_DEPTH];
    auto load = [&](int st0) {
#pragma unroll
        for (int d = 0; d < Q4K_DEPTH; ++d) {
            int st = st0 + d * TC_WARPS;
            if (st < steps) {
                h0[d] = *(const uint4*)(w0 + (st >> 1) * 144);
                h1[d] = *(const uint4*)(w1 + (st >> 1) * 144);
                p0[d] = *(const uint4*)(w0 + qs_at(st));
                p1[d] = *(const uint4*)(w1 + qs_at(st));
            }
        }
    };
    load(warp);  // weights do not depend on the previous kernel
    pdl_enter();
    for (int e = threadIdx.x; e < m * K / 4; e += TC_WARPS * 32) xs[e] = x_fragment(((const float4*)x)[e]);
    __syncthreads();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int st0 = warp; st0 < steps; st0 += TC_WARPS * Q4K_DEPTH) {
        if (st0 != warp) load(st0);
#pragma unroll
        for (int d = 0; d < Q4K_DEPTH; ++d) {
            int st = st0 + d * TC_WARPS;
            if (st >= steps) break;
            int chunk = 2 * (st & 1) + c;
            u32 s0l, m0l, s0h, m0h, s1l, m1l, s1h, m1h;
            q4k_scale_min(h0[d], 2 * chunk, s0l, m0l);
            q4k_scale_min(h0[d], 2 * chunk + 1, s0h, m0h);
            q4k_scale_min(h1[d], 2 * chunk, s1l, m1l);
            q4k_scale_min(h1[d], 2 * chunk + 1, s1h, m1h);
            u32 a[4] = {p0[d].x, p0[d].y, p0[d].z, p0[d].w}, b[4] = {p1[d].x, p1[d].y, p1[d].z, p1[d].w};
            // Quad (4 consecutive k) of word w's low nibbles; the high ones are 8 quads on.
            long long quad = (long long)(st >> 1) * 64 + 16 * chunk + 4 * half;
            const uint2* xr = xs + (long long)(has_x ? g : 0) * (K / 4) + quad;
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                u32 ra[4], rb[4];
                q4k_word(a[w], s0l, m0l, s0h, m0h, ra);
                q4k_word(b[w], s1l, m1l, s1h, m1h, rb);
#pragma unroll
                for (int hi = 0; hi < 2; ++hi) {
                    uint2 xf = has_x ? xr[w + 8 * hi] : make_uint2(0u, 0u);
                    mma_rows16(acc, ra, rb, hi, xf);
                }
            }
        }
    }
    store_rows16(partial, acc, y, ldy, n0, m, N);
}

// The Q4_1 GEMV on tensor cores, the same scheme for up to 8 staged rows of x: Q4_1 rows
// are 20-byte blocks of 32 weights (f16 d and m, then 16 bytes whose low nibbles are
// elements 0–15 and high ones 16–31), w = n · d + m. A step of a warp's 16 rows takes four
// blocks, one a thread; K need not be a multiple of 128 (576 in the default model), so a
// thread past the row's last block multiplies zeros. Past 4 rows the alternative is a
// bf16 copy of the matrix for cuBLAS every step (verify steps at batch 1, decode at 5–8).
extern "C" __global__ void __launch_bounds__(TC_WARPS * 32, 2)
    gemv_q4_1_mma_kernel(float* y, int ldy, const float* x, const u8* W, int m, int N, int K) {
    __shared__ float partial[TC_WARPS][16][8];
    extern __shared__ uint2 xs[];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    long long n0 = (long long)blockIdx.x * 16;
    long long r0 = n0 + g < N ? n0 + g : n0, r1 = n0 + g + 8 < N ? n0 + g + 8 : n0;
    int num_blocks = K / 32;
    long long row_bytes = (long long)num_blocks * 20;
    const u32* w0 = (const u32*)(W + r0 * row_bytes);
    const u32* w1 = (const u32*)(W + r1 * row_bytes);
    int steps = (num_blocks + 3) / 4;
    bool has_x = g < m;
    // Block b's five words: d and m, then the nibbles.
    u32 q0[Q4K_DEPTH][5], q1[Q4K_DEPTH][5];
    auto load = [&](int st0) {
#pragma unroll
        for (int d = 0; d < Q4K_DEPTH; ++d) {
            int b = (st0 + d * TC_WARPS) * 4 + t;
            if (b < num_blocks) {
#pragma unroll
                for (int i = 0; i < 5; ++i) {
                    q0[d][i] = w0[b * 5 + i];
                    q1[d][i] = w1[b * 5 + i];
                }
            }
        }
    };
    load(warp);
    pdl_enter();
    for (int e = threadIdx.x; e < m * K / 4; e += TC_WARPS * 32) xs[e] = x_fragment(((const float4*)x)[e]);
    __syncthreads();
    float acc[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int st0 = warp; st0 < steps; st0 += TC_WARPS * Q4K_DEPTH) {
        if (st0 != warp) load(st0);
#pragma unroll
        for (int d = 0; d < Q4K_DEPTH; ++d) {
            int st = st0 + d * TC_WARPS;
            if (st >= steps) break;
            int b = st * 4 + t;
            bool live = b < num_blocks;
            u32 ra[4] = {0u, 0u, 0u, 0u}, rb[4] = {0u, 0u, 0u, 0u};
            const uint2* xr = xs + (long long)(has_x ? g : 0) * (K / 4) + (long long)b * 8;
            u32 s0 = q0[d][0] & 0xffffu, s1 = q1[d][0] & 0xffffu;
            u32 d0 = s0 | (s0 << 16), d1 = s1 | (s1 << 16);
            u32 m0 = (q0[d][0] >> 16) | (q0[d][0] & 0xffff0000u);
            u32 m1 = (q1[d][0] >> 16) | (q1[d][0] & 0xffff0000u);
#pragma unroll
            for (int w = 0; w < 4; ++w) {
                if (live) {
                    // Low nibbles with (d, m), high ones likewise: one scale for the block.
                    q4k_word(q0[d][1 + w], d0, m0, d0, m0, ra);
                    q4k_word(q1[d][1 + w], d1, m1, d1, m1, rb);
                }
#pragma unroll
                for (int hi = 0; hi < 2; ++hi) {
                    uint2 xf = has_x && live ? xr[w + 4 * hi] : make_uint2(0u, 0u);
                    mma_rows16(acc, ra, rb, hi, xf);
                }
            }
        }
    }
    store_rows16(partial, acc, y, ldy, n0, m, N);
}
