// Decode-sized steps of MXFP4 experts on the tensor cores (appended after moe_pipe.cu;
// `mp_copy16` from moe_pipe.cu). The CUDA-core GEMV it replaces (a lane a run of 512
// values) was bound by issue: ~7.5 instructions a weight to decode E2M1, take each value
// out of its bf16 pair and multiply-add it (Nsight: 66 % SM throughput, 23 % DRAM; 40 µs
// for V4-Flash's up pass, 53.6 MB). Here a weight costs its decode only: a warp
// multiplies 16 weight rows by the pair's input row with mma.m16n8k16 (f16 operands, f32
// sums; n = the one input row, the other 7 columns zero), one mma a 16 × 16 piece.
//
// E2M1 → f16 by integer ops: a code's 3 magnitude bits at f16 bits 11..9 and its sign at
// 15 make the f16 of its value · 2^-14, exact (the 0.5 code an f16 subnormal). A block's
// scale multiplies its sum (two mmas, one 32-value block of every row) in f32, after 2^14
// and the input's 2^4 (x goes to f16 · 2^-4, as in fp8_mma.cu, so |x| up to 2^20 fits).
//
// Thread (g, t) takes code bytes 4t .. 4t + 3 of rows g and g + 8's block (8 codes a row:
// nibble j is the block's value 8t + j); the pairs (j, j + 4) are its A registers — the
// first mma's k slots (2t, 2t + 1, 2t + 8, 2t + 9) hold values (8t, 8t + 4, 8t + 1, 8t + 5),
// the second's (8t + 2, 8t + 6, 8t + 3, 8t + 7) — and the input row is staged in shared
// memory in that order (`xs`: a uint4 a (block, t), the two mmas' B registers), so lanes
// g = 0 read theirs in one load. The products are summed in another order than the CUDA-
// core GEMV's (default mode only; the invariant mode takes the tile kernels).
//
// Weights: each warp brings its 16 rows' next chunk of 16 blocks (272 bytes a row,
// 16-byte aligned) into its own shared stage by cp.async while it multiplies the other;
// a row's stage is 68 words, so lanes (g, t) reading word 68g + c + t hit 32 banks.
// Block: 4 warps, 16 rows each (SWIGLU: 8 gate rows and their 8 up rows, so a thread
// holds both sums); grid: (feature blocks, pairs). The up pass adds each pair to `counts`.
// K a multiple of 512, at most 8 192; dynamic shared memory MG_SMEM_BYTES(K). Four warps,
// not eight: V4-Flash's batch-1 up pass made 192 blocks of 8 over 132 SMs, 60 of them
// doing twice the others' work; 384 blocks of 4 spread evenly (330 → 337 tok/s).
#define MG_WARPS 4
#define MG_CHUNK 16
#define MG_ROW_WORDS (MG_CHUNK * 17 / 4)
#define MG_STAGE_WORDS (16 * MG_ROW_WORDS)
#define MG_X_SCALE 0.0625f
#define MG_UNSCALE 262144.0f  // 2^14 · 2^4
// (+16: the last row's code loads read one word past it, unused where its shift is 0)
#define MG_SMEM_BYTES(K) (2 * (K) + MG_WARPS * 2 * MG_STAGE_WORDS * 4 + 16)

// Codes (j, j + 4) of `q` (nibble 0 lowest; `m` its magnitude bits, `s` its sign bits) as
// f16x2 of their values · 2^-14, code j in the low half.
__device__ __forceinline__ u32 mg_pair(u32 m, u32 s, int j) {
    return (((m >> (4 * j)) & 0x00070007u) << 9) | (((s >> (4 * j)) & 0x00080008u) << 12);
}

__device__ __forceinline__ void mg_mma(float c[4], u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
        "{%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ u32 mg_f16x2(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

// 2^(e − 127) (e = 0: the ue8m0 code's 2^-127).
__device__ __forceinline__ float mg_scale(u32 e) { return __int_as_float(e != 0 ? e << 23 : 0x00400000u); }

template <bool SWIGLU>
__device__ void moe_gemv_mma(float* out, const float* x, int x_div, const u32* chosen, const u64* w1,
                             const u64* w2, u32* counts, int N, int K, float limit) {
    extern __shared__ __align__(16) unsigned char mg_raw[];
    uint4* xs = (uint4*)mg_raw;  // [K / 32][4]
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
    u32* ws = (u32*)(mg_raw + 2 * K) + warp * 2 * MG_STAGE_WORDS;
    int p = blockIdx.y, e = chosen[p];
    if (counts != nullptr && blockIdx.x == 0 && threadIdx.x == 0) atomicAdd(&counts[e], 1u);
    long long row_bytes = (long long)(K / 32) * 17;
    // This warp's 16 rows; rows past N read row N − 1 (their sums are not stored).
    int f0 = (blockIdx.x * MG_WARPS + warp) * (SWIGLU ? 8 : 16);
    // The expert's bases read once: the copies' "memory" clobber would reload them each time.
    const u8* gate_w = (const u8*)w1[e];
    const u8* up_w = SWIGLU ? (const u8*)w2[e] : gate_w;
    auto row_ptr = [&](int i) {
        const u8* base = SWIGLU && i >= 8 ? up_w : gate_w;
        int f = SWIGLU ? f0 + (i & 7) : f0 + i;
        return base + (long long)min(f, N - 1) * row_bytes;
    };
    auto load = [&](int c, int s) {
        u32* dst = ws + s * MG_STAGE_WORDS;
        for (int i = lane; i < 16 * 17; i += 32) {
            int r = i / 17, j = i % 17;
            mp_copy16(dst + r * MG_ROW_WORDS + 4 * j, row_ptr(r) + (long long)c * MG_CHUNK * 17 + 16 * j);
        }
        asm volatile("cp.async.commit_group;" ::: "memory");
    };
    int chunks = K / (32 * MG_CHUNK);
    load(0, 0);
    // The pair's input row as the B registers, in the order the A registers take values.
    const float* xr = x + (long long)(p / x_div) * K;
    for (int i = threadIdx.x; i < K / 8; i += blockDim.x) {
        float4 a = *(const float4*)(xr + 8 * i), b = *(const float4*)(xr + 8 * i + 4);
        xs[i] = make_uint4(mg_f16x2(a.x * MG_X_SCALE, b.x * MG_X_SCALE), mg_f16x2(a.y * MG_X_SCALE, b.y * MG_X_SCALE),
                           mg_f16x2(a.z * MG_X_SCALE, b.z * MG_X_SCALE), mg_f16x2(a.w * MG_X_SCALE, b.w * MG_X_SCALE));
    }
    __syncthreads();
    float acc_a = 0.0f, acc_b = 0.0f;  // rows g and g + 8, input column 0 (lanes t = 0)
    for (int c = 0; c < chunks; ++c) {
        if (c + 1 < chunks) {
            load(c + 1, (c + 1) & 1);
            asm volatile("cp.async.wait_group 1;" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;" ::: "memory");
        }
        __syncwarp();
        const u32* ra = ws + (c & 1) * MG_STAGE_WORDS + g * MG_ROW_WORDS;
        const u32* rb = ra + 8 * MG_ROW_WORDS;
#pragma unroll
        for (int b = 0; b < MG_CHUNK; ++b) {
            // Block b's exponent at byte 17b, its code bytes 4t .. 4t + 3 at 17b + 1 + 4t.
            int ew = (17 * b) >> 2, eb = 8 * ((17 * b) & 3);
            int cw = ((17 * b + 1) >> 2) + t, cs = 8 * ((17 * b + 1) & 3);
            u32 qa = __funnelshift_r(ra[cw], ra[cw + 1], cs), qb = __funnelshift_r(rb[cw], rb[cw + 1], cs);
            float sa = mg_scale((ra[ew] >> eb) & 0xffu), sb = mg_scale((rb[ew] >> eb) & 0xffu);
            uint4 xf = g == 0 ? xs[(c * MG_CHUNK + b) * 4 + t] : make_uint4(0u, 0u, 0u, 0u);
            u32 ma = qa & 0x77777777u, sga = qa & 0x88888888u, mb = qb & 0x77777777u, sgb = qb & 0x88888888u;
            float s[4] = {0.0f, 0.0f, 0.0f, 0.0f};
            mg_mma(s, mg_pair(ma, sga, 0), mg_pair(mb, sgb, 0), mg_pair(ma, sga, 1), mg_pair(mb, sgb, 1), xf.x, xf.y);
            mg_mma(s, mg_pair(ma, sga, 2), mg_pair(mb, sgb, 2), mg_pair(ma, sga, 3), mg_pair(mb, sgb, 3), xf.z, xf.w);
            // MG_UNSCALE first: exact on the small sums, where the scale's product with it
            // could overflow for the largest exponents.
            acc_a = fmaf(sa, s[0] * MG_UNSCALE, acc_a);
            acc_b = fmaf(sb, s[2] * MG_UNSCALE, acc_b);
        }
        __syncwarp();  // the stage is read before the next chunk's copies overwrite it
    }
    if (t != 0) return;
    if (SWIGLU) {
        int f = f0 + g;
        if (f >= N) return;
        float gt = fminf(acc_a, limit);
        float u = fminf(fmaxf(acc_b, -limit), limit);
        out[(long long)p * N + f] = gt * (1.0f / (1.0f + expf(-gt))) * u;
    } else {
        if (f0 + g < N) out[(long long)p * N + f0 + g] = acc_a;
        if (f0 + g + 8 < N) out[(long long)p * N + f0 + g + 8] = acc_b;
    }
}

extern "C" __global__ void __launch_bounds__(MG_WARPS * 32)
    dsv4_moe_gemv_mma_up_mxfp4_kernel(float* out, const float* x, int x_div, const u32* chosen, const u64* w1,
                                      const u64* w2, u32* counts, int N, int K, float limit) {
    moe_gemv_mma<true>(out, x, x_div, chosen, w1, w2, counts, N, K, limit);
}

extern "C" __global__ void __launch_bounds__(MG_WARPS * 32)
    dsv4_moe_gemv_mma_down_mxfp4_kernel(float* out, const float* x, int x_div, const u32* chosen, const u64* w1,
                                        const u64* w2, u32* counts, int N, int K, float limit) {
    moe_gemv_mma<false>(out, x, x_div, chosen, w1, w2, counts, N, K, limit);
}
