// Paged attention by splits of a row's keys, for the rows the flash and tensor-core
// kernels do not take (the batch-invariant mode's every row): after llama.cu, whose
// helpers (kv_load, block reductions, SPLIT_ROW, FLASH_ROW) it uses.

// Causal attention over the paged cache, any mix of prefill and decode rows. Per row:
// `row_table` = offset of its sequence's block table in `block_tables`, `row_visible` = keys
// it may see (its position + 1; 0 for a padding row; FLASH_ROW set: flash_prefill_kernel's
// row, skipped). Grid (rows, heads, splits): the row's
// keys fall in 64-key chunks at fixed positions, each split takes a contiguous run of
// ceil(chunks / splits) of them and folds them in order with an online softmax. With one
// split the block writes the normalised output; otherwise it leaves (max, sum, unnormalised
// output) for `attention_combine_kernel`. A row's result depends on its own keys and the
// split count only, so a fixed split count is batch-invariant. 128 threads, head_dim ≤ 256.
#define ATT_CHUNK 64

// Keys [start, end) of split `split`: a contiguous run of ceil(chunks / splits) whole
// chunks, the same runs in every kernel that splits a row, so the combine reads them alike.
__device__ __forceinline__ int2 split_keys(int visible, int split, int num_splits) {
    int num_chunks = (visible + ATT_CHUNK - 1) / ATT_CHUNK;
    int per_split = (num_chunks + num_splits - 1) / num_splits;
    int start = split * per_split * ATT_CHUNK;
    return make_int2(start, min(visible, start + per_split * ATT_CHUNK));
}

// An fp8 cache passes its scales per (slot, kv head) (`k_scales`, `v_scales`; null else):
// a key's score and a value's weight take its scale.
template <typename T>
__device__ void attention_split(
    float* out, float* part_o, float* part_ml, const float* q, const T* k_cache,
    const T* v_cache, const float* k_scales, const float* v_scales, const u32* block_tables,
    const u32* row_table, const u32* row_visible, const u32* split_rows, int num_heads,
    int num_kv_heads, int head_dim, int block_size, float scale, int num_splits) {
    __shared__ float q_s[256];
    __shared__ float p_s[ATT_CHUNK];
    __shared__ float scratch[32];
    int row = SPLIT_ROW(split_rows), h = blockIdx.y, split = blockIdx.z;
    u32 flagged = row_visible[row];
    if (flagged & FLASH_ROW) return;
    int visible = flagged;
    int2 keys = split_keys(visible, split, num_splits);
    int start = keys.x, end = keys.y;
    int kvh = h / (num_heads / num_kv_heads);
    int kv_dim = num_kv_heads * head_dim;
    const u32* table = block_tables + row_table[row];
    const float* qr = q + ((long long)row * num_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = qr[d] * scale;
    __syncthreads();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    int d0 = threadIdx.x, d1 = threadIdx.x + blockDim.x;
    float m = NEG_INF, l = 0.0f, acc0 = 0.0f, acc1 = 0.0f;
    for (int c0 = start; c0 < end; c0 += ATT_CHUNK) {
        int c1 = min(end, c0 + ATT_CHUNK);
        float local_max = NEG_INF;
        for (int j = c0 + warp; j < c1; j += num_warps) {
            long long slot = (long long)table[j / block_size] * block_size + j % block_size;
            const T* kr = k_cache + slot * kv_dim + kvh * head_dim;
            float s = 0.0f;
            for (int d = lane; d < head_dim; d += 32) s += q_s[d] * kv_load(kr, d);
            s = warp_sum(s);
            if (k_scales) s *= k_scales[slot * num_kv_heads + kvh];
            if (lane == 0) p_s[j - c0] = s;
            local_max = fmaxf(local_max, s);
        }
        float m_new = fmaxf(m, block_max(local_max, scratch));
        __syncthreads();
        float local_sum = 0.0f;
        for (int j = threadIdx.x; j < c1 - c0; j += blockDim.x) {
            float p = expf(p_s[j] - m_new);
            p_s[j] = p;
            local_sum += p;
        }
        float chunk_sum = block_sum(local_sum, scratch);
        __syncthreads();
        float alpha = expf(m - m_new);  // 0 on the first chunk: m is −∞
        l = l * alpha + chunk_sum;
        float s0 = 0.0f, s1 = 0.0f;
        for (int j = c0; j < c1; ++j) {
            long long slot = (long long)table[j / block_size] * block_size + j % block_size;
            const T* vr = v_cache + slot * kv_dim + kvh * head_dim;
            float p = p_s[j - c0];
            if (v_scales) p *= v_scales[slot * num_kv_heads + kvh];
            if (d0 < head_dim) s0 += p * kv_load(vr, d0);
            if (d1 < head_dim) s1 += p * kv_load(vr, d1);
        }
        acc0 = acc0 * alpha + s0;
        acc1 = acc1 * alpha + s1;
        m = m_new;
        __syncthreads();
    }
    if (num_splits == 1) {
        float* o = out + ((long long)row * num_heads + h) * head_dim;
        float inv = l > 0.0f ? 1.0f / l : 0.0f;
        if (d0 < head_dim) o[d0] = acc0 * inv;
        if (d1 < head_dim) o[d1] = acc1 * inv;
        return;
    }
    long long part = ((long long)row * num_heads + h) * num_splits + split;
    if (d0 < head_dim) part_o[part * head_dim + d0] = acc0;
    if (d1 < head_dim) part_o[part * head_dim + d1] = acc1;
    if (threadIdx.x == 0) {
        part_ml[2 * part] = m;
        part_ml[2 * part + 1] = l;
    }
}

#define SPLIT_ENTRY(NAME, T)                                                                    \
    extern "C" __global__ void NAME(float* out, float* part_o, float* part_ml, const float* q,  \
                                    const T* k_cache, const T* v_cache, const u32* block_tables,  \
                                    const u32* row_table, const u32* row_visible,                \
                                    const u32* split_rows, int num_heads, int num_kv_heads,       \
                                    int head_dim, int block_size, float scale, int num_splits) {  \
        pdl_enter();                                                                            \
        attention_split(out, part_o, part_ml, q, k_cache, v_cache, (const float*)0,              \
                        (const float*)0, block_tables, row_table, row_visible, split_rows,       \
                        num_heads, num_kv_heads, head_dim, block_size, scale, num_splits);       \
    }
SPLIT_ENTRY(attention_split_f32_kernel, float)
SPLIT_ENTRY(attention_split_bf16_kernel, bf16_t)
extern "C" __global__ void attention_split_fp8_kernel(
    float* out, float* part_o, float* part_ml, const float* q, const u8* k_cache,
    const u8* v_cache, const u32* block_tables, const u32* row_table, const u32* row_visible,
    const u32* split_rows, int num_heads, int num_kv_heads, int head_dim, int block_size,
    float scale, int num_splits, const float* k_scales, const float* v_scales) {
    pdl_enter();
    attention_split(out, part_o, part_ml, q, k_cache, v_cache, k_scales, v_scales, block_tables,
                    row_table, row_visible, split_rows, num_heads, num_kv_heads, head_dim,
                    block_size, scale, num_splits);
}

// Merges the splits' partial softmax sums of one (row, head). A thread reads each split's
// (max, sum) and the block reduces them, rather than one thread walking the splits in
// turn: at batch 1 that walk was a chain of dependent loads. Empty splits (most of them at
// short contexts, where a graph's fixed split count exceeds the chunks) are skipped.
// num_splits ≤ blockDim (the host's MAX_SPLITS ≤ 128).
extern "C" __global__ void attention_combine_kernel(float* out, const float* part_o,
                                                    const float* part_ml, const u32* row_visible,
                                                    const u32* split_rows, int num_heads,
                                                    int head_dim, int num_splits) {
    pdl_enter();
    __shared__ float scratch[32];
    __shared__ float weight[128];
    int row = SPLIT_ROW(split_rows), h = blockIdx.y;
    if (row_visible[row] & FLASH_ROW) return;  // flash_prefill_kernel's row
    long long base = ((long long)row * num_heads + h) * num_splits;
    int s = threadIdx.x;
    float ms = NEG_INF, ls = 0.0f;
    if (s < num_splits) {
        ms = part_ml[2 * (base + s)];
        ls = part_ml[2 * (base + s) + 1];
    }
    float m = block_max(ms, scratch);
    float ws = ms != NEG_INF ? expf(ms - m) : 0.0f;
    float l = block_sum(ls * ws, scratch);
    if (s < num_splits) weight[s] = ws;
    __syncthreads();
    float* o = out + ((long long)row * num_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
#pragma unroll 8
        for (int j = 0; j < num_splits; ++j) {
            if (weight[j] != 0.0f) acc += part_o[(base + j) * head_dim + d] * weight[j];
        }
        o[d] = l > 0.0f ? acc / l : 0.0f;  // a padding row sees no keys
    }
}
