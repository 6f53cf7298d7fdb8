// Paged decode attention on tensor cores over a bf16 or fp8 KV cache (appended to llama.cu's
// source). Compiled once per head_dim; any number of query heads per KV head up to 8.
//
// A SIMT kernel spends as many instructions as the memory system had bytes
// to give: per key and head, a 16-lane dot product, a 4-level shuffle reduction, an exp and
// a 16-lane update of the output, so it stalls at ~0.80 of the copy bandwidth with the
// SM's issue slots two-thirds busy. Here one mma.m16n8k16 computes the scores of 8 keys for
// every query head of the group (the heads are the 16 rows of the A operand, rows past the
// group zero), and the output update is another mma per 8 dimensions: per 16 keys a warp
// issues 2·HD/16 + HD/8 mma and as many ldmatrix, against ~40 instructions per key.
//
// One block per (row, KV head, split); its 4 warps take 16 keys each of every 64-key stage.
// Stages stream into shared memory by cp.async, DM_STAGES − 1 ahead of the one folded, rows
// padded by 16 bytes so ldmatrix is free of bank conflicts. Each warp keeps an online softmax
// per head (scores and probabilities rounded to bf16 for the mma, as the flash prefill does);
// the warps merge at the end and leave the same partials as attention_split for
// attention_combine_kernel. Splits cover the same ATT_CHUNK runs. The block size must be a
// power of two (block_shift = log2). 128 threads.

// Asynchronous 16-byte copies from global to shared memory: no registers held while the
// bytes are in flight.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem) {
    u32 s;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                 : "=r"(s) : "l"(smem));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// bf16 pairs for the tensor-core fragments (`mma_bf16`, mma_tile.cu).
__device__ __forceinline__ u32 pack_bf16(float lo, float hi) {
    return (u32)f32_to_bf16(lo) | ((u32)f32_to_bf16(hi) << 16);
}

#define DM_KEYS 64
#define DM_STAGES 3
#define DM_MAX_GROUP 8

__device__ __forceinline__ u32 smem_u32(const void* p) {
    u32 s;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                 : "=r"(s) : "l"(p));
    return s;
}

// Four 8×8 bf16 matrices from shared memory; lane l names row l % 8 of matrix l / 8. Thread
// (g, t) = (lane / 4, lane % 4) gets row g, columns 2t and 2t + 1 of each; `.trans` gives it
// column g, rows 2t and 2t + 1 instead.
__device__ __forceinline__ void ldmatrix_x4(u32* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32* r, const bf16_t* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(smem_u32(p)));
}

__device__ __forceinline__ void cp_async4(void* smem, const void* gmem) {
    u32 s;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }"
                 : "=r"(s) : "l"(smem));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(gmem) : "memory");
}

// f16 operands (the fp8 cache's: e4m3 codes are exact in f16), f32 accumulators.
__device__ __forceinline__ void mma_f16(float* c, u32 a0, u32 a1, u32 a2, u32 a3, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
__device__ __forceinline__ u32 pack_f16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
// Four e4m3 codes (the low byte first) as two f16 pairs, exactly.
__device__ __forceinline__ uint2 e4m3x4_f16(u32 w) {
    u32 lo, hi;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(lo) : "h"((unsigned short)(w & 0xffffu)));
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(hi) : "h"((unsigned short)(w >> 16)));
    return make_uint2(lo, hi);
}

// Four e4m3 codes (the low byte first) times `scale`, as two bf16 pairs.
__device__ __forceinline__ uint2 e4m3x4_scaled_bf16(u32 w, float scale) {
    float2 lo = kv_e4m3x2(w & 0xffffu), hi = kv_e4m3x2(w >> 16);
    return make_uint2(pack_bf16(lo.x * scale, lo.y * scale), pack_bf16(hi.x * scale, hi.y * scale));
}

// FP8: the stages hold the raw codes (half the bf16 tile's bytes, streamed the same way)
// and each key's scale; a warp turns its 16 keys of the stage into f16 codes (exact, one
// instruction a pair) in a tile of its own just before its mma, so one tile serves every
// stage. The mma run in f16: a key's scale multiplies its scores, and a value's scale
// (over the largest of the warp's 16, so probabilities stay in [0, 1]) its probabilities,
// the largest applied to the 16 keys' sum before it joins the output.
template <int HD, bool FP8>
__device__ void attention_decode_mma(float* out, float* part_o, float* part_ml, const float* q,
                                     const void* k_cache, const void* v_cache,
                                     const float* k_scales, const float* v_scales,
                                     const u32* block_tables, const u32* row_table,
                                     const u32* row_visible, const u32* split_rows,
                                     int num_kv_heads, int group, int block_shift, float scale,
                                     int num_splits) {
    constexpr int RS = HD + 8;       // row stride in bf16
    constexpr int PIECES = HD / 8;   // 16-byte pieces of a key
    constexpr int DSTEPS = HD / 16;  // k-steps of the scores
    constexpr int DTILES = HD / 8;   // n-tiles of the output
    // bf16: [stage][K, V][DM_KEYS][RS]. FP8: [K, V][DM_KEYS][RS], then the codes
    // [stage][K, V][DM_KEYS][HD], then the scales [stage][K, V][DM_KEYS].
    extern __shared__ __align__(16) bf16_t dm_smem[];
    u8* raw = (u8*)(dm_smem + 2 * DM_KEYS * RS);
    constexpr int STAGES = DM_STAGES;
    float* raw_scales = (float*)(raw + STAGES * 2 * DM_KEYS * HD);
    __shared__ float s_m[4][DM_MAX_GROUP], s_l[4][DM_MAX_GROUP];
    int row = SPLIT_ROW(split_rows), kvh = blockIdx.y, split = blockIdx.z;
    u32 flagged = row_visible[row];
    if (flagged & FLASH_ROW) return;
    int visible = flagged;
    int2 keys = split_keys(visible, split, num_splits);
    int start = keys.x, end = keys.y;
    int num_heads = num_kv_heads * group;
    long long kv_dim = (long long)num_kv_heads * HD;
    const u32* table = block_tables + row_table[row];
    int block_mask = (1 << block_shift) - 1;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    long long head_off = (long long)kvh * HD;

    // The DM_KEYS keys from c0 and their values into `stage` (keys past the end zeroed); one
    // commit group per call, empty past the end, so that waits count calls.
    auto issue = [&](int c0, int stage) {
        bf16_t* ks = dm_smem + stage * 2 * DM_KEYS * RS;
        bf16_t* vs = ks + DM_KEYS * RS;
        if (FP8 && c0 < end) {
            u8* kr = raw + stage * 2 * DM_KEYS * HD;
            u8* vr = kr + DM_KEYS * HD;
            float* sk = raw_scales + stage * 2 * DM_KEYS;
            for (int e = threadIdx.x; e < DM_KEYS * (HD / 16); e += blockDim.x) {
                int key = e / (HD / 16), piece = e % (HD / 16), j = c0 + key;
                uint4* kd = (uint4*)(kr + key * HD + piece * 16);
                uint4* vd = (uint4*)(vr + key * HD + piece * 16);
                if (j < end) {
                    long long slot =
                        ((long long)table[j >> block_shift] << block_shift) + (j & block_mask);
                    long long at = slot * kv_dim + head_off + piece * 16;
                    cp_async16(kd, (const u8*)k_cache + at);
                    cp_async16(vd, (const u8*)v_cache + at);
                } else {
                    *kd = make_uint4(0u, 0u, 0u, 0u);
                    *vd = make_uint4(0u, 0u, 0u, 0u);
                }
            }
            for (int key = threadIdx.x; key < DM_KEYS; key += blockDim.x) {
                int j = c0 + key;
                if (j < end) {
                    long long slot =
                        ((long long)table[j >> block_shift] << block_shift) + (j & block_mask);
                    long long at = slot * num_kv_heads + kvh;
                    cp_async4(sk + key, k_scales + at);
                    cp_async4(sk + DM_KEYS + key, v_scales + at);
                } else {
                    sk[key] = 0.0f;
                    sk[DM_KEYS + key] = 0.0f;
                }
            }
        } else if (!FP8 && c0 < end) {
            for (int e = threadIdx.x; e < DM_KEYS * PIECES; e += blockDim.x) {
                int key = e / PIECES, piece = e % PIECES, j = c0 + key;
                uint4* kd = (uint4*)(ks + key * RS + piece * 8);
                uint4* vd = (uint4*)(vs + key * RS + piece * 8);
                if (j < end) {
                    long long slot =
                        ((long long)table[j >> block_shift] << block_shift) + (j & block_mask);
                    long long at = slot * kv_dim + head_off + piece * 8;
                    cp_async16(kd, (const bf16_t*)k_cache + at);
                    cp_async16(vd, (const bf16_t*)v_cache + at);
                } else {
                    *kd = make_uint4(0u, 0u, 0u, 0u);
                    *vd = make_uint4(0u, 0u, 0u, 0u);
                }
            }
        }
        cp_async_commit();
    };

    // Q as A fragments (row g = head g of the group, scaled, bf16): qa[kk] holds dims
    // 16kk + 2t, +1 and 16kk + 8 + 2t, +1; rows 8–15 are zero.
    u32 qa[DSTEPS][2];
    {
        bool has = g < group;
        const float* qr = q + ((long long)row * num_heads + kvh * group + (has ? g : 0)) * HD;
#pragma unroll
        for (int kk = 0; kk < DSTEPS; ++kk) {
            int d = 16 * kk + 2 * t;
            float2 a = *(const float2*)(qr + d), b = *(const float2*)(qr + d + 8);
            if (FP8) {
                qa[kk][0] = has ? pack_f16(a.x * scale, a.y * scale) : 0u;
                qa[kk][1] = has ? pack_f16(b.x * scale, b.y * scale) : 0u;
            } else {
                qa[kk][0] = has ? pack_bf16(a.x * scale, a.y * scale) : 0u;
                qa[kk][1] = has ? pack_bf16(b.x * scale, b.y * scale) : 0u;
            }
        }
    }
    // Head g's running maximum and this thread's share of its sum; its output at dims
    // 8nd + 2t, +1 in o[nd][0..1] (o[nd][2..3] are the zero rows' and stay zero).
    float m = NEG_INF, l = 0.0f;
    float o[DTILES][4];
#pragma unroll
    for (int i = 0; i < DTILES; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    int num = end > start ? (end - start + DM_KEYS - 1) / DM_KEYS : 0;
#pragma unroll
    for (int c = 0; c < STAGES - 1; ++c) issue(start + c * DM_KEYS, c);
    for (int c = 0; c < num; ++c) {
        cp_async_wait<STAGES - 2>();  // stage c has landed
        __syncthreads();                  // for every thread; stage c − 1 is consumed
        issue(start + (c + STAGES - 1) * DM_KEYS, (c + STAGES - 1) % STAGES);
        int k0 = start + c * DM_KEYS + warp * 16;  // this warp's first key
        if (k0 >= end) continue;
        const bf16_t* ks = dm_smem + (FP8 ? 0 : (c % STAGES) * 2 * DM_KEYS * RS) + warp * 16 * RS;
        const bf16_t* vs = ks + DM_KEYS * RS;
        if (FP8) {
            // The warp's 16 keys and values of stage c, as f16 codes, into its rows of the
            // tile (its last mma has read them: ldmatrix returns the values).
            const u8* kr = raw + (c % STAGES) * 2 * DM_KEYS * HD + warp * 16 * HD;
            const u8* vr = kr + DM_KEYS * HD;
            __syncwarp();
            // 16 codes a step: one 16-byte load, eight conversions, two 16-byte stores.
            auto widen = [](uint4 w, bf16_t* dst) {
                uint2 a = e4m3x4_f16(w.x), b = e4m3x4_f16(w.y);
                uint2 c2 = e4m3x4_f16(w.z), d2 = e4m3x4_f16(w.w);
                *(uint4*)dst = make_uint4(a.x, a.y, b.x, b.y);
                *(uint4*)(dst + 8) = make_uint4(c2.x, c2.y, d2.x, d2.y);
            };
#pragma unroll
            for (int e = lane; e < 16 * HD / 16; e += 32) {
                int key = e / (HD / 16), d = (e % (HD / 16)) * 16;
                widen(*(const uint4*)(kr + key * HD + d), (bf16_t*)ks + key * RS + d);
                widen(*(const uint4*)(vr + key * HD + d), (bf16_t*)vs + key * RS + d);
            }
            __syncwarp();
        }
        int mat = lane >> 3, r = lane & 7;

        // Scores of the warp's 16 keys: n-tile nt holds keys 8nt + 2t, +1 of head g.
        float s[2][4] = {{0.0f, 0.0f, 0.0f, 0.0f}, {0.0f, 0.0f, 0.0f, 0.0f}};
#pragma unroll
        for (int kk = 0; kk < DSTEPS; ++kk) {
            u32 b[4];  // (keys 0–7, dims 16kk..+7), (keys 0–7, +8..), (keys 8–15, ..), (..)
            ldmatrix_x4(b, ks + (8 * (mat >> 1) + r) * RS + 16 * kk + 8 * (mat & 1));
            if (FP8) {
                mma_f16(s[0], qa[kk][0], 0u, qa[kk][1], 0u, b[0], b[1]);
                mma_f16(s[1], qa[kk][0], 0u, qa[kk][1], 0u, b[2], b[3]);
            } else {
                mma_bf16(s[0], qa[kk][0], 0u, qa[kk][1], 0u, b[0], b[1]);
                mma_bf16(s[1], qa[kk][0], 0u, qa[kk][1], 0u, b[2], b[3]);
            }
        }
        // FP8: this warp's keys' scales (key 8nt + 2t, +1 of its 16 for this thread).
        const float* sk = raw_scales + (c % STAGES) * 2 * DM_KEYS + warp * 16;
        if (FP8) {
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                s[nt][0] *= sk[8 * nt + 2 * t];
                s[nt][1] *= sk[8 * nt + 2 * t + 1];
            }
        }
        float mx = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            int j = k0 + 8 * nt + 2 * t;
            if (j >= end) s[nt][0] = NEG_INF;
            if (j + 1 >= end) s[nt][1] = NEG_INF;
            mx = fmaxf(mx, fmaxf(s[nt][0], s[nt][1]));
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        // Key k0 is visible (k0 < end), so the maximum is finite.
        float m_new = fmaxf(m, mx);
        float alpha = expf(m - m_new);  // 0 on the warp's first keys
        m = m_new;
        float p00 = expf(s[0][0] - m), p01 = expf(s[0][1] - m);
        float p10 = expf(s[1][0] - m), p11 = expf(s[1][1] - m);
        l = l * alpha + (p00 + p01) + (p10 + p11);
#pragma unroll
        for (int nd = 0; nd < DTILES; ++nd) {
            o[nd][0] *= alpha;
            o[nd][1] *= alpha;
        }
        // P as the A operand: keys 2t, +1 (n-tile 0) and 8 + 2t, +1 (n-tile 1) of head g.
        if (FP8) {
            const float* sv = sk + DM_KEYS;
            float vmax = 0.0f;
#pragma unroll
            for (int k = 0; k < 16; ++k) vmax = fmaxf(vmax, sv[k]);
            float inv = vmax > 0.0f ? 1.0f / vmax : 0.0f;
            int k0t = 2 * t, k1t = 8 + 2 * t;
            u32 pa0 = pack_f16(p00 * sv[k0t] * inv, p01 * sv[k0t + 1] * inv);
            u32 pa2 = pack_f16(p10 * sv[k1t] * inv, p11 * sv[k1t + 1] * inv);
#pragma unroll
            for (int nd = 0; nd < DTILES; nd += 2) {
                u32 b[4];
                ldmatrix_x4_trans(b, vs + (8 * (mat & 1) + r) * RS + 8 * (nd + (mat >> 1)));
                float d0[4] = {0.0f, 0.0f, 0.0f, 0.0f}, d1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
                mma_f16(d0, pa0, 0u, pa2, 0u, b[0], b[1]);
                mma_f16(d1, pa0, 0u, pa2, 0u, b[2], b[3]);
                o[nd][0] += d0[0] * vmax;
                o[nd][1] += d0[1] * vmax;
                o[nd + 1][0] += d1[0] * vmax;
                o[nd + 1][1] += d1[1] * vmax;
            }
        } else {
            u32 pa0 = pack_bf16(p00, p01), pa2 = pack_bf16(p10, p11);
#pragma unroll
            for (int nd = 0; nd < DTILES; nd += 2) {
                u32 b[4];  // Vᵀ: (keys 0–7, dims 8nd..), (keys 8–15, 8nd..), (0–7, 8nd + 8..), (..)
                ldmatrix_x4_trans(b, vs + (8 * (mat & 1) + r) * RS + 8 * (nd + (mat >> 1)));
                mma_bf16(o[nd], pa0, 0u, pa2, 0u, b[0], b[1]);
                mma_bf16(o[nd + 1], pa0, 0u, pa2, 0u, b[2], b[3]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    // The warps' partial results, in the staging memory (every copy has landed, every
    // thread is done with it).
    float* s_o = (float*)dm_smem;  // [4][DM_MAX_GROUP][HD]
    if (g < group) {
        if (t == 0) {
            s_m[warp][g] = m;
            s_l[warp][g] = l;
        }
#pragma unroll
        for (int nd = 0; nd < DTILES; ++nd) {
            float* dst = s_o + (warp * DM_MAX_GROUP + g) * HD + 8 * nd + 2 * t;
            dst[0] = o[nd][0];
            dst[1] = o[nd][1];
        }
    }
    __syncthreads();
    for (int e = threadIdx.x; e < group * HD; e += blockDim.x) {
        int gg = e / HD, d = e % HD;
        float mm = NEG_INF;
        for (int w = 0; w < 4; ++w) mm = fmaxf(mm, s_m[w][gg]);
        float ll = 0.0f, acc = 0.0f;
        for (int w = 0; w < 4; ++w) {
            float mw = s_m[w][gg];
            if (mw == NEG_INF) continue;
            float f = expf(mw - mm);
            ll += s_l[w][gg] * f;
            acc += s_o[(w * DM_MAX_GROUP + gg) * HD + d] * f;
        }
        int h = kvh * group + gg;
        if (num_splits == 1) {
            out[((long long)row * num_heads + h) * HD + d] = ll > 0.0f ? acc / ll : 0.0f;
        } else {
            long long pi = ((long long)row * num_heads + h) * num_splits + split;
            part_o[pi * HD + d] = acc;
            if (d == 0) {
                part_ml[2 * pi] = mm;
                part_ml[2 * pi + 1] = ll;
            }
        }
    }
}

// Dynamic shared memory of attention_decode_mma<HD, FP8>, in bytes (the Rust side mirrors
// it): bf16 DM_STAGES · 2 · DM_KEYS · (HD + 8) · 2; FP8 2 · DM_KEYS · (HD + 8) · 2 +
// DM_STAGES · 2 · DM_KEYS · (HD + 4).

#define DECODE_MMA_ENTRY(HD)                                                                   \
    extern "C" __global__ void __launch_bounds__(128) attention_decode_mma_##HD##_kernel(      \
        float* out, float* part_o, float* part_ml, const float* q, const bf16_t* k_cache,      \
        const bf16_t* v_cache, const u32* block_tables, const u32* row_table,                 \
        const u32* row_visible, const u32* split_rows, int num_kv_heads, int group,           \
        int block_shift, float scale, int num_splits) {                                        \
        pdl_enter();                                                                           \
        attention_decode_mma<HD, false>(out, part_o, part_ml, q, k_cache, v_cache,            \
                                        (const float*)0, (const float*)0, block_tables,       \
                                        row_table, row_visible, split_rows, num_kv_heads,     \
                                        group, block_shift, scale, num_splits);               \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) attention_decode_mma_fp8_##HD##_kernel(  \
        float* out, float* part_o, float* part_ml, const float* q, const u8* k_cache,          \
        const u8* v_cache, const u32* block_tables, const u32* row_table,                     \
        const u32* row_visible, const u32* split_rows, int num_kv_heads, int group,           \
        int block_shift, float scale, int num_splits, const float* k_scales,                   \
        const float* v_scales) {                                                               \
        pdl_enter();                                                                           \
        attention_decode_mma<HD, true>(out, part_o, part_ml, q, k_cache, v_cache, k_scales,   \
                                       v_scales, block_tables, row_table, row_visible,        \
                                       split_rows, num_kv_heads, group, block_shift, scale,   \
                                       num_splits);                                           \
    }
DECODE_MMA_ENTRY(64)
DECODE_MMA_ENTRY(128)
