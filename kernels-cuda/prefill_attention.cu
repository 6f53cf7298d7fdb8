// Flash-style prefill attention on tensor cores, over a bf16 or fp8 paged KV cache (appended to
// llama.cu's source after decode_attention.cu, whose mma and cp.async helpers it uses). One block per (tile of up to 64 query rows of one sequence, head);
// each of its 4 warps owns 16 query rows. Per 64-key chunk the block stages the keys
// (row-major, by cp.async) and the values (transposed) in shared memory; a warp computes
// S = Q·Kᵀ with mma.m16n8k16 (bf16 operands, f32 accumulators), folds S into an online
// softmax per row, and accumulates O += P·V with P re-used from the S accumulators as the
// A operand (the C and A fragment layouts line up over two adjacent n-tiles). Rows keep
// their maximum and a per-thread partial sum; the four threads of a row add theirs at the
// end. Chunks start at key 0, so a row's result does not depend on its tile. Row padding
// of one 16-byte word keeps the fragment loads free of bank conflicts.
// tiles[4·i ..] = (first query row, rows, block-table offset, position of the first row).
// Rows it handles are flagged in row_visible (FLASH_ROW) so the decode kernels skip them.
// 128 threads.
#define FA_ROWS 64
#define FA_KEYS 64

// FP8: keys and values are read as e4m3 codes and staged as bf16 code × scale (the
// scales per slot and KV head in k_scales / v_scales).
template <int HD, bool FP8>
__device__ void flash_prefill_mma(float* out, const float* q, const void* k_cache,
                                  const void* v_cache, const float* k_scales,
                                  const float* v_scales, const u32* block_tables,
                                  const u32* tiles, int num_heads, int num_kv_heads,
                                  int block_size, float scale) {
    constexpr int KS = HD + 8;       // K row stride in bf16 (16 bytes of padding)
    constexpr int VS = FA_KEYS + 8;  // Vᵀ row stride in bf16
    constexpr int DSTEPS = HD / 16;  // k-steps of Q·Kᵀ
    constexpr int DTILES = HD / 8;   // n-tiles of O
    __shared__ __align__(16) bf16_t k_s[FA_KEYS * KS];
    __shared__ __align__(16) bf16_t vt_s[HD * VS];
    const u32* tile = tiles + 4 * blockIdx.x;
    int first_row = tile[0], num_rows = tile[1];
    const u32* table = block_tables + tile[2];
    int first_pos = tile[3];
    int h = blockIdx.y, kvh = h / (num_heads / num_kv_heads);
    long long kv_dim = (long long)num_kv_heads * HD;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    int r0 = warp * 16 + g, r1 = r0 + 8;  // this thread's two rows within the tile

    // Q as A fragments, scaled, in bf16: qa[kk] covers dims 16kk .. 16kk + 15.
    u32 qa[DSTEPS][4];
    {
        const float* q0 = q + ((long long)(first_row + min(r0, num_rows - 1)) * num_heads + h) * HD;
        const float* q1 = q + ((long long)(first_row + min(r1, num_rows - 1)) * num_heads + h) * HD;
#pragma unroll
        for (int kk = 0; kk < DSTEPS; ++kk) {
            int d = 16 * kk + 2 * t;
            qa[kk][0] = pack_bf16(q0[d] * scale, q0[d + 1] * scale);
            qa[kk][1] = pack_bf16(q1[d] * scale, q1[d + 1] * scale);
            qa[kk][2] = pack_bf16(q0[d + 8] * scale, q0[d + 9] * scale);
            qa[kk][3] = pack_bf16(q1[d + 8] * scale, q1[d + 9] * scale);
        }
    }
    int visible0 = first_pos + r0 + 1, visible1 = first_pos + r1 + 1;
    int num_keys = first_pos + num_rows;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    float o[DTILES][4];
#pragma unroll
    for (int i = 0; i < DTILES; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    for (int c0 = 0; c0 < num_keys; c0 += FA_KEYS) {
        __syncthreads();  // the previous chunk is consumed
        // Keys: 16-byte pieces, row-major. Values: two keys' 8 dims → 8 transposed pairs.
        for (int e = threadIdx.x; e < FA_KEYS * (HD / 8); e += blockDim.x) {
            int key = e / (HD / 8), piece = e % (HD / 8), j = c0 + key;
            uint4* dst = (uint4*)(k_s + key * KS + piece * 8);
            if (j < num_keys) {
                long long slot = (long long)table[j / block_size] * block_size + j % block_size;
                long long at = slot * kv_dim + (long long)kvh * HD + piece * 8;
                if (FP8) {
                    uint2 c = *(const uint2*)((const u8*)k_cache + at);
                    float ks = k_scales[slot * num_kv_heads + kvh];
                    uint2 lo = e4m3x4_scaled_bf16(c.x, ks), hi = e4m3x4_scaled_bf16(c.y, ks);
                    *dst = make_uint4(lo.x, lo.y, hi.x, hi.y);
                } else {
                    cp_async16(dst, (const bf16_t*)k_cache + at);
                }
            } else {
                *dst = make_uint4(0u, 0u, 0u, 0u);
            }
        }
        cp_async_commit();
        for (int e = threadIdx.x; e < (FA_KEYS / 2) * (HD / 8); e += blockDim.x) {
            int pair = e / (HD / 8), piece = e % (HD / 8);
            uint4 va = make_uint4(0u, 0u, 0u, 0u), vb = va;
            int j = c0 + 2 * pair;
            // Key j's 8 dims of this piece, as bf16.
            auto value = [&](int j) {
                long long slot = (long long)table[j / block_size] * block_size + j % block_size;
                long long at = slot * kv_dim + (long long)kvh * HD + piece * 8;
                if (!FP8) return *(const uint4*)((const bf16_t*)v_cache + at);
                uint2 c = *(const uint2*)((const u8*)v_cache + at);
                float vs = v_scales[slot * num_kv_heads + kvh];
                uint2 lo = e4m3x4_scaled_bf16(c.x, vs), hi = e4m3x4_scaled_bf16(c.y, vs);
                return make_uint4(lo.x, lo.y, hi.x, hi.y);
            };
            if (j < num_keys) va = value(j);
            if (j + 1 < num_keys) vb = value(j + 1);
            u32 wa[4] = {va.x, va.y, va.z, va.w}, wb[4] = {vb.x, vb.y, vb.z, vb.w};
#pragma unroll
            for (int x = 0; x < 4; ++x) {
                int d = piece * 8 + 2 * x;
                // dim d: low halves; dim d + 1: high halves. Keys 2·pair (low), 2·pair + 1.
                *(u32*)(vt_s + d * VS + 2 * pair) = (wa[x] & 0xffffu) | (wb[x] << 16);
                *(u32*)(vt_s + (d + 1) * VS + 2 * pair) = (wa[x] >> 16) | (wb[x] & 0xffff0000u);
            }
        }
        cp_async_wait<0>();
        __syncthreads();

        // S = Q·Kᵀ for this warp's 16 rows and the chunk's 64 keys.
        float s[FA_KEYS / 8][4];
#pragma unroll
        for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            const bf16_t* kr = k_s + (8 * nt + g) * KS + 2 * t;
#pragma unroll
            for (int kk = 0; kk < DSTEPS; ++kk) {
                u32 b0 = *(const u32*)(kr + 16 * kk), b1 = *(const u32*)(kr + 16 * kk + 8);
                mma_bf16(s[nt], qa[kk][0], qa[kk][1], qa[kk][2], qa[kk][3], b0, b1);
            }
        }
        float mx0 = NEG_INF, mx1 = NEG_INF;
#pragma unroll
        for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
            int j = c0 + 8 * nt + 2 * t;
            if (j >= visible0) s[nt][0] = NEG_INF;
            if (j + 1 >= visible0) s[nt][1] = NEG_INF;
            if (j >= visible1) s[nt][2] = NEG_INF;
            if (j + 1 >= visible1) s[nt][3] = NEG_INF;
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        // Key 0 lies in the first chunk and every row sees it: the maxima are finite.
        float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        float alpha0 = expf(m0 - n0), alpha1 = expf(m1 - n1);  // 0 on the first chunk
        m0 = n0;
        m1 = n1;
        l0 *= alpha0;
        l1 *= alpha1;
#pragma unroll
        for (int i = 0; i < DTILES; ++i) {
            o[i][0] *= alpha0;
            o[i][1] *= alpha0;
            o[i][2] *= alpha1;
            o[i][3] *= alpha1;
        }
        // P in bf16 as A fragments: k-step ks (keys 16ks ..) is n-tiles 2ks and 2ks + 1.
        u32 pa[FA_KEYS / 16][4];
#pragma unroll
        for (int nt = 0; nt < FA_KEYS / 8; ++nt) {
            float p0 = expf(s[nt][0] - m0), p1 = expf(s[nt][1] - m0);
            float p2 = expf(s[nt][2] - m1), p3 = expf(s[nt][3] - m1);
            l0 += p0 + p1;
            l1 += p2 + p3;
            pa[nt / 2][(nt & 1) * 2] = pack_bf16(p0, p1);
            pa[nt / 2][(nt & 1) * 2 + 1] = pack_bf16(p2, p3);
        }
        // O += P·V: B fragments from Vᵀ (dims as n, keys as k).
#pragma unroll
        for (int nd = 0; nd < DTILES; ++nd) {
            const bf16_t* vr = vt_s + (8 * nd + g) * VS + 2 * t;
#pragma unroll
            for (int ks = 0; ks < FA_KEYS / 16; ++ks) {
                u32 b0 = *(const u32*)(vr + 16 * ks), b1 = *(const u32*)(vr + 16 * ks + 8);
                mma_bf16(o[nd], pa[ks][0], pa[ks][1], pa[ks][2], pa[ks][3], b0, b1);
            }
        }
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    float inv0 = 1.0f / l0, inv1 = 1.0f / l1;
#pragma unroll
    for (int nd = 0; nd < DTILES; ++nd) {
        int d = 8 * nd + 2 * t;
        if (r0 < num_rows) {
            float* o0 = out + ((long long)(first_row + r0) * num_heads + h) * HD + d;
            o0[0] = o[nd][0] * inv0;
            o0[1] = o[nd][1] * inv0;
        }
        if (r1 < num_rows) {
            float* o1 = out + ((long long)(first_row + r1) * num_heads + h) * HD + d;
            o1[0] = o[nd][2] * inv1;
            o1[1] = o[nd][3] * inv1;
        }
    }
}

#define FLASH_ENTRY(HD)                                                                        \
    extern "C" __global__ void __launch_bounds__(128) flash_prefill_##HD##_kernel(             \
        float* out, const float* q, const bf16_t* k_cache, const bf16_t* v_cache,              \
        const u32* block_tables, const u32* tiles, int num_heads, int num_kv_heads,            \
        int block_size, float scale) { pdl_enter();                                            \
        flash_prefill_mma<HD, false>(out, q, k_cache, v_cache, (const float*)0,                \
                                     (const float*)0, block_tables, tiles, num_heads,          \
                                     num_kv_heads, block_size, scale);                         \
    }                                                                                          \
    extern "C" __global__ void __launch_bounds__(128) flash_prefill_fp8_##HD##_kernel(         \
        float* out, const float* q, const u8* k_cache, const u8* v_cache,                      \
        const u32* block_tables, const u32* tiles, int num_heads, int num_kv_heads,            \
        int block_size, float scale, const float* k_scales, const float* v_scales) {           \
        pdl_enter();                                                                           \
        flash_prefill_mma<HD, true>(out, q, k_cache, v_cache, k_scales, v_scales,              \
                                    block_tables, tiles, num_heads, num_kv_heads, block_size,  \
                                    scale);                                                    \
    }
FLASH_ENTRY(64)
FLASH_ENTRY(128)
