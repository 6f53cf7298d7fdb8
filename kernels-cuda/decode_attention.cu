// Paged decode attention over a bf16 KV cache, grouped by KV head (appended to llama.cu's
// source, whose helpers it uses). Compiled once per head_dim and query heads per KV head.
//
// One block per (row, KV head, split) computes all G query heads that share the KV head, so
// each key and value is read once per row instead of G times. The kernel is bound by memory
// bandwidth, and what keeps the bandwidth is bytes in flight: the block copies keys and
// values into shared memory with asynchronous 16-byte copies (cp.async, no registers held),
// GQA_STAGE_KEYS keys a stage, two stages ahead of the one it folds. There a key's
// head_dim values are read by HD/8 lanes, 16 bytes each; each lane group keeps its own
// online softmax over its keys of every chunk, and the groups merge at the end. Splits cover
// contiguous runs of ATT_CHUNK-key chunks exactly as attention_split's do, and leave the
// same partials for attention_combine_kernel. 128 threads.
#define GQA_WARPS 4

__device__ __forceinline__ void bf16x8_to_f32(uint4 raw, float* out) {
    u32 w[4] = {raw.x, raw.y, raw.z, raw.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        out[2 * i] = __uint_as_float(w[i] << 16);  // little-endian: element 2i is the low half
        out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
}

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

// Dynamic shared memory of attention_gqa<HD, G>, in bytes (the Rust side mirrors it):
// GQA_STAGES stages of GQA_STAGE_KEYS keys and values, reused at the end for the groups'
// partial sums.
#define GQA_STAGES 3
#define GQA_STAGE_KEYS 32
#define GQA_SMEM_BYTES(HD, G) ((384 * (HD)) > (4096 * (G)) ? (384 * (HD)) : (4096 * (G)))

template <int HD, int G>
__device__ void attention_gqa(float* out, float* part_o, float* part_ml, const float* q,
                              const bf16_t* k_cache, const bf16_t* v_cache,
                              const u32* block_tables, const u32* row_table,
                              const u32* row_visible, const u32* split_rows, int num_kv_heads,
                              int block_size, float scale, int num_splits) {
    constexpr int LANES = HD / 8;             // lanes reading one key (16 bytes each)
    constexpr int GROUPS = 32 / LANES;        // keys a warp reads at once
    constexpr int NG = GQA_WARPS * GROUPS;    // lane groups in the block
    constexpr int SK = GQA_STAGE_KEYS;
    constexpr int PER_GROUP = SK / NG;        // keys of a stage each group folds
    constexpr int U = G > 4 ? 2 : (PER_GROUP < 4 ? PER_GROUP : 4);  // keys unpacked at once
    extern __shared__ uint4 gqa_smem[];       // [stage][K, V][SK][LANES]
    __shared__ float s_m[NG][G], s_l[NG][G];
    int row = SPLIT_ROW(split_rows), kvh = blockIdx.y, split = blockIdx.z;
    u32 flagged = row_visible[row];
    if (flagged & FLASH_ROW) return;
    int visible = flagged;
    int num_chunks = (visible + ATT_CHUNK - 1) / ATT_CHUNK;
    int per_split = (num_chunks + num_splits - 1) / num_splits;
    int start = split * per_split * ATT_CHUNK;
    int end = min(visible, start + per_split * ATT_CHUNK);
    int num_heads = num_kv_heads * G;
    long long kv_dim = (long long)num_kv_heads * HD;
    const u32* table = block_tables + row_table[row];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int group = lane / LANES, part = lane % LANES;
    int gid = warp * GROUPS + group;
    long long head_off = (long long)kvh * HD;

    // The SK keys from c0 and their values into `stage`, asynchronously (keys past the end
    // zeroed); one commit group per call, empty past the end, so that waits count calls.
    auto issue = [&](int c0, int stage) {
        uint4* ks = gqa_smem + (stage * 2) * SK * LANES;
        uint4* vs = ks + SK * LANES;
        if (c0 < end) {
            for (int e = threadIdx.x; e < SK * LANES; e += blockDim.x) {
                int key = e / LANES, piece = e % LANES, j = c0 + key;
                if (j < end) {
                    long long slot =
                        (long long)table[j / block_size] * block_size + j % block_size;
                    long long at = slot * kv_dim + head_off + piece * 8;
                    cp_async16(ks + e, k_cache + at);
                    cp_async16(vs + e, v_cache + at);
                } else {
                    ks[e] = make_uint4(0u, 0u, 0u, 0u);
                    vs[e] = make_uint4(0u, 0u, 0u, 0u);
                }
            }
        }
        cp_async_commit();
    };

    float qv[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        const float* qr = q + ((long long)row * num_heads + kvh * G + g) * HD + part * 8;
        float4 a = *(const float4*)qr, b = *(const float4*)(qr + 4);
        qv[g][0] = a.x * scale; qv[g][1] = a.y * scale; qv[g][2] = a.z * scale;
        qv[g][3] = a.w * scale; qv[g][4] = b.x * scale; qv[g][5] = b.y * scale;
        qv[g][6] = b.z * scale; qv[g][7] = b.w * scale;
    }
    float m[G], l[G], acc[G][8];
#pragma unroll
    for (int g = 0; g < G; ++g) {
        m[g] = NEG_INF;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < 8; ++i) acc[g][i] = 0.0f;
    }
    int num = end > start ? (end - start + SK - 1) / SK : 0;
    // GQA_STAGES − 1 stages stream in ahead of the one being folded.
#pragma unroll
    for (int c = 0; c < GQA_STAGES - 1; ++c) issue(start + c * SK, c);
    for (int c = 0; c < num; ++c) {
        cp_async_wait<GQA_STAGES - 2>();  // stage c has landed
        __syncthreads();                   // for every thread; stage c − 1 is consumed
        issue(start + (c + GQA_STAGES - 1) * SK, (c + GQA_STAGES - 1) % GQA_STAGES);
        const uint4* ks = gqa_smem + ((c % GQA_STAGES) * 2) * SK * LANES;
        const uint4* vs = ks + SK * LANES;
        int c0 = start + c * SK;
#pragma unroll
        for (int u0 = 0; u0 < PER_GROUP; u0 += U) {
            int k0 = gid * PER_GROUP + u0;  // first key of this batch within the chunk
            uint4 kr[U], vr[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                kr[u] = ks[(k0 + u) * LANES + part];
                vr[u] = vs[(k0 + u) * LANES + part];
            }
            float p[G][U];
            float alpha[G];
#pragma unroll
            for (int g = 0; g < G; ++g) {
                float s[U];
                float mx = NEG_INF;
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    float kf[8];
                    bf16x8_to_f32(kr[u], kf);
                    float dot = 0.0f;
#pragma unroll
                    for (int i = 0; i < 8; ++i) dot = fmaf(qv[g][i], kf[i], dot);
#pragma unroll
                    for (int o = LANES / 2; o > 0; o >>= 1)
                        dot += __shfl_xor_sync(0xffffffffu, dot, o);
                    s[u] = c0 + k0 + u < end ? dot : NEG_INF;
                    mx = fmaxf(mx, s[u]);
                }
                float m_new = fmaxf(m[g], mx);
                if (m_new == NEG_INF) {  // nothing visible yet in this group
                    alpha[g] = 1.0f;
#pragma unroll
                    for (int u = 0; u < U; ++u) p[g][u] = 0.0f;
                    continue;
                }
                alpha[g] = expf(m[g] - m_new);  // 0 while m is −∞
                float sum = 0.0f;
#pragma unroll
                for (int u = 0; u < U; ++u) {
                    p[g][u] = expf(s[u] - m_new);
                    sum += p[g][u];
                }
                l[g] = l[g] * alpha[g] + sum;
                m[g] = m_new;
            }
#pragma unroll
            for (int g = 0; g < G; ++g)
#pragma unroll
                for (int i = 0; i < 8; ++i) acc[g][i] *= alpha[g];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                float vf[8];
                bf16x8_to_f32(vr[u], vf);
#pragma unroll
                for (int g = 0; g < G; ++g)
#pragma unroll
                    for (int i = 0; i < 8; ++i) acc[g][i] = fmaf(p[g][u], vf[i], acc[g][i]);
            }
        }
    }
    cp_async_wait<0>();
    __syncthreads();
    // The groups' partial sums, in the staging memory (every copy has landed, every thread
    // is done with it).
    float* s_acc = (float*)gqa_smem;  // [NG][G][HD]
#pragma unroll
    for (int g = 0; g < G; ++g) {
        if (part == 0) {
            s_m[gid][g] = m[g];
            s_l[gid][g] = l[g];
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) s_acc[(gid * G + g) * HD + part * 8 + i] = acc[g][i];
    }
    __syncthreads();
    for (int e = threadIdx.x; e < G * HD; e += blockDim.x) {
        int g = e / HD, d = e % HD;
        float mm = NEG_INF;
        for (int n = 0; n < NG; ++n) mm = fmaxf(mm, s_m[n][g]);
        float ll = 0.0f, o = 0.0f;
        for (int n = 0; n < NG; ++n) {
            float mn = s_m[n][g];
            if (mn == NEG_INF) continue;
            float w = expf(mn - mm);
            ll += s_l[n][g] * w;
            o += s_acc[(n * G + g) * HD + d] * w;
        }
        int h = kvh * G + g;
        if (num_splits == 1) {
            out[((long long)row * num_heads + h) * HD + d] = ll > 0.0f ? o / ll : 0.0f;
        } else {
            long long pi = ((long long)row * num_heads + h) * num_splits + split;
            part_o[pi * HD + d] = o;
            if (d == 0) {
                part_ml[2 * pi] = mm;
                part_ml[2 * pi + 1] = ll;
            }
        }
    }
}

#define GQA_ENTRY(HD, G)                                                                       \
    extern "C" __global__ void __launch_bounds__(128)                                          \
        attention_gqa_##HD##_##G##_kernel(float* out, float* part_o, float* part_ml,           \
                                          const float* q, const bf16_t* k_cache,              \
                                          const bf16_t* v_cache, const u32* block_tables,     \
                                          const u32* row_table, const u32* row_visible,       \
                                          const u32* split_rows, int num_kv_heads,            \
                                          int block_size, float scale, int num_splits) {      \
        pdl_enter();                                                                           \
        attention_gqa<HD, G>(out, part_o, part_ml, q, k_cache, v_cache, block_tables,         \
                             row_table, row_visible, split_rows, num_kv_heads, block_size,    \
                             scale, num_splits);                                               \
    }
GQA_ENTRY(64, 1)
GQA_ENTRY(64, 2)
GQA_ENTRY(64, 3)
GQA_ENTRY(64, 4)
GQA_ENTRY(64, 8)
GQA_ENTRY(128, 1)
GQA_ENTRY(128, 2)
GQA_ENTRY(128, 3)
GQA_ENTRY(128, 4)
GQA_ENTRY(128, 8)
