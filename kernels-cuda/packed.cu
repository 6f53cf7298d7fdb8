// Weights kept packed on the device (appended to llama.cu's source): FP8 e4m3 with an f32
// scale per block_rows × block_cols block (HF block scales, per channel, per tensor), and
// GGML blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) as the GGUF file stores them. Decode GEMVs
// dequantize in registers; a wider batch dequantizes the matrix to bf16 (`dequant_bf16`)
// for cuBLAS; embedding rows are dequantized as they are gathered.
typedef unsigned char u8;

#define GGML_Q4_0 2
#define GGML_Q4_1 3
#define GGML_Q8_0 8
#define GGML_Q4_K 12
#define GGML_Q6_K 14
// DeepSeek-V4's MXFP4 as troupe blocks it on upload: an E8M0 exponent, then 16 bytes of
// E2M1 pairs (value 2l in the low nibble of byte l, 2l + 1 in its high one). Not GGUF's
// MXFP4 (type 39), whose nibbles split the block in halves.
#define TROUPE_MXFP4 100

__device__ __forceinline__ float f16_bits_to_f32(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float f16_at(const u8* p) {
    return f16_bits_to_f32((unsigned short)(p[0] | (p[1] << 8)));
}

// Two e4m3 bytes (the low byte first) to f32, through the hardware's e4m3x2 → f16x2.
__device__ __forceinline__ float2 e4m3x2_to_f32(unsigned short v) {
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(v));
    return make_float2(f16_bits_to_f32((unsigned short)(h2 & 0xffffu)),
                       f16_bits_to_f32((unsigned short)(h2 >> 16)));
}

__device__ __forceinline__ float e4m3_to_f32(u8 b) { return e4m3x2_to_f32((unsigned short)b).x; }

// f32 → e4m3, nearest with ties to even, saturating at ±448 (torch's rounding).
__device__ __forceinline__ u8 f32_to_e4m3(float v) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;" : "=h"(r) : "f"(v));
    return (u8)(r & 0xffu);
}

// Bytes of one GGML block and the elements it holds.
__device__ __forceinline__ int ggml_block_bytes(int fmt) {
    switch (fmt) {
        case GGML_Q4_0: return 18;
        case GGML_Q4_1: return 20;
        case GGML_Q8_0: return 34;
        case GGML_Q4_K: return 144;
        case TROUPE_MXFP4: return 17;
        default: return 210;  // GGML_Q6_K
    }
}
__device__ __forceinline__ int ggml_block_len(int fmt) {
    return fmt == GGML_Q4_K || fmt == GGML_Q6_K ? 256 : 32;
}

// The 32 values of group `u` (elements 32u .. 32u + 31) of a GGML row.
// E2M1 codes 0..7 (the sign is bit 3).
__constant__ float E2M1_MAGNITUDE[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};

__device__ __forceinline__ float e2m1(u32 code, float scale) {
    float v = E2M1_MAGNITUDE[code & 7] * scale;
    return (code & 8) ? -v : v;
}

__device__ __forceinline__ void ggml_group(const u8* row, int fmt, int u, float* w) {
    if (fmt == TROUPE_MXFP4) {
        const u8* b = row + (long long)u * 17;
        // 2^(e - 127) by its bits; e = 0 (2^-127, a subnormal) by the multiply.
        float scale = b[0] != 0 ? __int_as_float((int)b[0] << 23) : ldexpf(1.0f, -127);
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            w[2 * l] = e2m1(b[1 + l] & 15, scale);
            w[2 * l + 1] = e2m1(b[1 + l] >> 4, scale);
        }
        return;
    }
    if (fmt == GGML_Q8_0 || fmt == GGML_Q4_0 || fmt == GGML_Q4_1) {
        const u8* b = row + (long long)u * ggml_block_bytes(fmt);
        float d = f16_at(b);
        if (fmt == GGML_Q8_0) {
#pragma unroll
            for (int l = 0; l < 32; ++l) w[l] = d * (float)(signed char)b[2 + l];
        } else if (fmt == GGML_Q4_0) {
#pragma unroll
            for (int l = 0; l < 16; ++l) {
                w[l] = d * (float)((b[2 + l] & 15) - 8);
                w[l + 16] = d * (float)((b[2 + l] >> 4) - 8);
            }
        } else {
            float m = f16_at(b + 2);
#pragma unroll
            for (int l = 0; l < 16; ++l) {
                w[l] = fmaf(d, (float)(b[4 + l] & 15), m);
                w[l + 16] = fmaf(d, (float)(b[4 + l] >> 4), m);
            }
        }
        return;
    }
    const u8* b = row + (long long)(u >> 3) * ggml_block_bytes(fmt);
    int s = u & 7;
    if (fmt == GGML_Q4_K) {
        float d = f16_at(b), dmin = f16_at(b + 2);
        const u8* sc = b + 4;
        int scale, min;
        if (s < 4) {
            scale = sc[s] & 63;
            min = sc[s + 4] & 63;
        } else {
            scale = (sc[s + 4] & 0xF) | ((sc[s - 4] >> 6) << 4);
            min = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
        }
        float d1 = d * (float)scale, m1 = dmin * (float)min;
        // 144-byte blocks of rows of whole blocks keep the 32 quant bytes 16-byte aligned:
        // two vector loads, not 32 byte loads.
        const uint4* q = (const uint4*)(b + 16 + 32 * (s >> 1));
        uint4 lo = q[0], hi = q[1];
        u32 words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
        int shift = (s & 1) * 4;
#pragma unroll
        for (int l = 0; l < 32; ++l)
            w[l] = d1 * (float)((words[l >> 2] >> (8 * (l & 3) + shift)) & 15) - m1;
        return;
    }
    // Q6_K: 128 low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, the f16 scale.
    int half = s >> 2, which = s & 3;
    const u8* ql = b + half * 64 + ((which & 1) ? 32 : 0);
    const u8* qh = b + 128 + half * 32;
    const signed char* sc = (const signed char*)(b + 192) + half * 8 + 2 * which;
    float d = f16_at(b + 208);
    int shift = (which >> 1) * 4;
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        int q = ((ql[l] >> shift) & 15) | (((qh[l] >> (2 * which)) & 3) << 4);
        w[l] = d * (float)sc[l >> 4] * (float)(q - 32);
    }
}

// y[i, n] (row stride ldy) = Σ_k x[i, k] · W[n, k] for GGML rows of K / 32 groups: one
// block of 4 warps per output column, a thread per group at a time.
template <int MAXM>
__device__ void gemv_ggml(float* y, int ldy, const float* x, const u8* W, int fmt, int m, int N,
                          int K) {
    __shared__ float partial[4][MAXM];
    int n = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const u8* row = W + (long long)n * (K / ggml_block_len(fmt)) * ggml_block_bytes(fmt);
    float acc[MAXM];
#pragma unroll
    for (int i = 0; i < MAXM; ++i) acc[i] = 0.0f;
    for (int u = threadIdx.x; u < K / 32; u += 128) {
        float w[32];
        ggml_group(row, fmt, u, w);
#pragma unroll
        for (int i = 0; i < MAXM; ++i) {
            if (i >= m) break;
            const float4* xr = (const float4*)(x + (long long)i * K + u * 32);
            float s = 0.0f;
#pragma unroll
            for (int v = 0; v < 8; ++v) {
                float4 a = xr[v];
                s = fmaf(a.x, w[4 * v], s);
                s = fmaf(a.y, w[4 * v + 1], s);
                s = fmaf(a.z, w[4 * v + 2], s);
                s = fmaf(a.w, w[4 * v + 3], s);
            }
            acc[i] += s;
        }
    }
#pragma unroll
    for (int i = 0; i < MAXM; ++i) {
        float v = warp_sum(acc[i]);
        if (lane == 0) partial[warp][i] = v;
    }
    __syncthreads();
    if (threadIdx.x < MAXM && threadIdx.x < m) {
        int i = threadIdx.x;
        y[(long long)i * ldy + n] = partial[0][i] + partial[1][i] + partial[2][i] + partial[3][i];
    }
}

// An e4m3 byte held in the top 8 bits of `r`, as f32 · 2^-120: the sign stays at bit 31
// and the 7 magnitude bits land on the f32's low exponent and top mantissa bits (an
// arithmetic shift, the copies of the sign cleared). Subnormals come out exact as f32
// subnormals. Three integer ops and no conversion instruction.
__device__ __forceinline__ float e4m3_top_raw(u32 r) {
    return __int_as_float(((int)r >> 4) & (int)0x87F00000);
}

// 16 e4m3 weights against 16 activations, each weight 2^-120 of its value: the caller's
// scale carries the 2^120 (a power of two). The raw products of tiny weights and small
// activations fall among f32 subnormals, an absolute error under 2^-150 before the 2^120:
// far below the sum's own rounding. Two chains, for the FMA latency.
__device__ __forceinline__ float dot16_e4m3(uint4 w, const float4* x4) {
    u32 words[4] = {w.x, w.y, w.z, w.w};
    float s0 = 0.0f, s1 = 0.0f;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
        u32 v = words[j];
        float4 a = x4[j];
        s0 = fmaf(a.x, e4m3_top_raw(v << 24), s0);
        s1 = fmaf(a.y, e4m3_top_raw(v << 16), s1);
        s0 = fmaf(a.z, e4m3_top_raw(v << 8), s0);
        s1 = fmaf(a.w, e4m3_top_raw(v), s1);
    }
    return s0 + s1;
}

// The FP8 twin of gemv.cu's kernel: a block owns COLS output columns, 8 warps split K,
// lanes read 16 bytes (16 weights) per load and hold GEMV_UNROLL loads in flight. K is a
// multiple of 16 and the scale blocks' width a multiple of 16 (or all of K), so each load
// lies in one scale block.
template <int MAXM, int COLS>
__device__ void gemv_fp8(float* y, int ldy, const float* x, const u8* W, const float* scales,
                         int block_rows, int block_cols, int m, int N, int K) {
    __shared__ float partial[GEMV_WARPS][MAXM][COLS];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    long long n0 = (long long)blockIdx.x * COLS;
    int grid_cols = (K + block_cols - 1) / block_cols;
    float acc[MAXM][COLS];
#pragma unroll
    for (int i = 0; i < MAXM; ++i)
#pragma unroll
        for (int c = 0; c < COLS; ++c) acc[i][c] = 0.0f;
    const u8* wc[COLS];
    const float* sc[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        long long col = n0 + c < N ? n0 + c : n0;  // past the end: a valid row, unused
        wc[c] = W + col * (long long)K;
        sc[c] = scales + (col / block_rows) * grid_cols;
    }
    // Not unrolled: a block's 16-byte loads already cover 4096 weights of each column (a
    // whole row of most projections), and unrolling took all 255 registers (12% occupancy).
#pragma unroll 1
    for (int k = (warp * 32 + lane) * 16; k < K; k += GEMV_WARPS * 512) {
        uint4 w[COLS];
        float s[COLS];
#pragma unroll
        for (int c = 0; c < COLS; ++c) {
            w[c] = *(const uint4*)(wc[c] + k);
            s[c] = sc[c][k / block_cols] * __int_as_float(0x7B800000);  // · 2^120
        }
#pragma unroll
        for (int i = 0; i < MAXM; ++i) {
            if (i >= m) break;
            // Loaded once for all the block's columns: reloading them per column made the
            // activations four times the weights' traffic.
            const float4* xr = (const float4*)(x + (long long)i * K + k);
            float4 xa[4] = {xr[0], xr[1], xr[2], xr[3]};
#pragma unroll
            for (int c = 0; c < COLS; ++c) acc[i][c] = fmaf(s[c], dot16_e4m3(w[c], xa), acc[i][c]);
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
    if (e < MAXM * COLS) {
        int i = e / COLS, c = e % COLS;
        float v = 0.0f;
#pragma unroll
        for (int w = 0; w < GEMV_WARPS; ++w) v += partial[w][i][c];
        if (i < m && n0 + c < N) y[(long long)i * ldy + n0 + c] = v;
    }
}

#define PACKED_GEMV_ENTRY(MAXM, COLS)                                                          \
    extern "C" __global__ void __launch_bounds__(128) gemv_ggml_##MAXM##_kernel(               \
        float* y, int ldy, const float* x, const u8* W, int fmt, int m, int N, int K) {        \
        pdl_enter();                                                                           \
        gemv_ggml<MAXM>(y, ldy, x, W, fmt, m, N, K);                                           \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(256) gemv_fp8_##MAXM##_kernel(                \
        float* y, int ldy, const float* x, const u8* W, const float* scales, int block_rows,   \
        int block_cols, int m, int N, int K) {                                                 \
        pdl_enter();                                                                           \
        gemv_fp8<MAXM, COLS>(y, ldy, x, W, scales, block_rows, block_cols, m, N, K);           \
    }
// 4 columns a block (gemv.cu has 2 at 1–2 rows): a row holds half the bytes of a bf16
// one, and a block with too little to stream spends its time in the reduction.
PACKED_GEMV_ENTRY(1, 4)
PACKED_GEMV_ENTRY(2, 4)
PACKED_GEMV_ENTRY(4, 4)

// The value of element (r, k) of a packed part (`fmt` 0: FP8 with its scale grid).
__device__ __forceinline__ float fp8_value(const u8* W, const float* scales, int block_rows,
                                           int block_cols, long long r, int k, int K) {
    int grid_cols = (K + block_cols - 1) / block_cols;
    return e4m3_to_f32(W[r * K + k]) * scales[(r / block_rows) * grid_cols + k / block_cols];
}

// out[(first_row + r) · K + k] = bf16 of element (r, k), for a part of `rows` rows: FP8
// (fmt 0) a thread per element, GGML a thread per group of 32.
extern "C" __global__ void dequant_bf16_kernel(bf16_t* out, const u8* W, const float* scales,
                                               int fmt, int block_rows, int block_cols,
                                               int first_row, int rows, int K) {
    pdl_enter();
    long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (fmt == 0) {
        if (t >= (long long)rows * K) return;
        long long r = t / K;
        int k = (int)(t % K);
        out[(first_row + r) * K + k] = f32_to_bf16(fp8_value(W, scales, block_rows, block_cols, r, k, K));
        return;
    }
    int groups = K / 32;
    if (t >= (long long)rows * groups) return;
    long long r = t / groups;
    int u = (int)(t % groups);
    const u8* row = W + r * (K / ggml_block_len(fmt)) * ggml_block_bytes(fmt);
    float w[32];
    ggml_group(row, fmt, u, w);
    // Four 16-byte stores, not 32 two-byte ones: a thread's group is 64 contiguous bytes,
    // and byte-sized stores at a 64-byte stride across the warp waste most of each sector.
    uint4* o = (uint4*)(out + (first_row + r) * K + u * 32);
#pragma unroll
    for (int v = 0; v < 4; ++v) {
        u32 p[4];
#pragma unroll
        for (int j = 0; j < 4; ++j)
            p[j] = (u32)f32_to_bf16(w[8 * v + 2 * j]) | ((u32)f32_to_bf16(w[8 * v + 2 * j + 1]) << 16);
        o[v] = make_uint4(p[0], p[1], p[2], p[3]);
    }
}

// `--dummy-weights`' MXFP4 (fp4.rs's `Mxfp4Matrix::random`) as 17-byte blocks: a thread a
// group, its exponent then its 16 bytes of codes (byte i of the codes from splitmix64).
extern "C" __global__ void random_mxfp4_kernel(u8* blocks, long long groups, unsigned long long seed,
                                               int exponent) {
    pdl_enter();
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    u8* b = blocks + g * 17;
    b[0] = (u8)exponent;
    for (int h = 0; h < 2; ++h) {
        unsigned long long word = splitmix64(seed ^ splitmix64((unsigned long long)(g * 2 + h)));
#pragma unroll
        for (int l = 0; l < 8; ++l) b[1 + h * 8 + l] = (u8)(word >> (8 * l));
    }
}

// GGUF's MXFP4 blocks (type 39: value j in the low nibble of byte j, value j + 16 in its
// high one) rewritten in place in TROUPE_MXFP4's pair order, a thread a block: routed
// experts kept in host memory in GGUF's order for the CPU's integer dot, streamed here for
// a step whose many rows make the copy cheaper than the CPU's products.
extern "C" __global__ void mxfp4_ggml_to_pairs_kernel(u8* blocks, long long groups) {
    pdl_enter();
    long long g = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= groups) return;
    u8* b = blocks + g * 17 + 1;
    u8 codes[32];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        codes[j] = b[j] & 15;
        codes[j + 16] = b[j] >> 4;
    }
#pragma unroll
    for (int l = 0; l < 16; ++l) b[l] = (u8)(codes[2 * l] | (codes[2 * l + 1] << 4));
}

// embedding_kernel over a packed part holding table rows first_row .. first_row + rows:
// tokens whose row lies elsewhere are another part's.
extern "C" __global__ void __launch_bounds__(256)
    embedding_packed_kernel(float* out, const u8* W, const float* scales, int fmt, int block_rows,
                            int block_cols, int first_row, int rows, const u32* ids,
                            const u32* picked, const u32* picks, int dim) {
    pdl_enter();
    int t = blockIdx.x;
    u32 id = ids[t];
    if (picked != 0 && picked[t] != NOT_PICKED) id = picks[picked[t]];
    long long r = (long long)id - first_row;
    if (r < 0 || r >= rows) return;
    float* o = out + (long long)t * dim;
    if (fmt == 0) {
        for (int k = threadIdx.x; k < dim; k += blockDim.x)
            o[k] = fp8_value(W, scales, block_rows, block_cols, r, k, dim);
        return;
    }
    const u8* row = W + r * (dim / ggml_block_len(fmt)) * ggml_block_bytes(fmt);
    for (int u = threadIdx.x; u < dim / 32; u += blockDim.x) {
        float w[32];
        ggml_group(row, fmt, u, w);
#pragma unroll
        for (int l = 0; l < 32; ++l) o[u * 32 + l] = w[l];
    }
}

// `--quantization fp8`: row r of the dense [rows, K] matrix (f32 `src`, or bf16 `src_bf16`
// where it is given) to e4m3 with scale = row amax / 448 (1 for an all-zero row), as the
// CPU's Fp8Matrix::quantize_rows does. One block of 256 threads per row.
extern "C" __global__ void __launch_bounds__(256)
    quantize_fp8_rows_kernel(u8* out, float* scales, const float* src, const bf16_t* src_bf16,
                             int K) {
    pdl_enter();
    __shared__ float warp_max[8];
    long long r = blockIdx.x;
    float amax = 0.0f;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        float v = src_bf16 != 0 ? bf16_to_f32(src_bf16[r * K + k]) : src[r * K + k];
        amax = fmaxf(amax, fabsf(v));
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x >> 5] = amax;
    __syncthreads();
    amax = 0.0f;
#pragma unroll
    for (int w = 0; w < 8; ++w) amax = fmaxf(amax, warp_max[w]);
    float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    if (threadIdx.x == 0) scales[r] = scale;
    for (int k = threadIdx.x; k < K; k += blockDim.x) {
        float v = src_bf16 != 0 ? bf16_to_f32(src_bf16[r * K + k]) : src[r * K + k];
        out[r * K + k] = f32_to_e4m3(v / scale);
    }
}
