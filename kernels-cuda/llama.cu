// troupe's CUDA kernels for the Llama family, compiled at start-up with NVRTC.
//
// Activations are f32 row-major [rows, width]; weights are bf16 (raw 16-bit words, so no
// toolkit header is needed at run time); the KV cache is
// [num_blocks * block_size, num_kv_heads * head_dim] per layer, in f32 (as on the CPU
// backend) or bf16.

// NVRTC has no <math.h>: −∞ by its bits.
#define NEG_INF (__int_as_float(0xff800000))
// The KV slot of a padding row (a graph's batch is padded to its bucket): nothing is written.
#define PAD_SLOT 0xffffffffu
// Marks, in row_visible, a row that flash_prefill_kernel computes.
#define FLASH_ROW 0x80000000u

typedef unsigned short bf16_t;
typedef unsigned int u32;

__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((u32)h) << 16);
}

__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 bits = __float_as_uint(f);
    if ((bits & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((bits >> 16) | 0x40u);  // NaN stays NaN
    }
    // Round to nearest, ties to even.
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16_t)(bits >> 16);
}

// The KV cache holds f32 (the batch-invariant mode: the CPU reference's numbers) or bf16
// (the default: half the bytes each decode step reads).
__device__ __forceinline__ float kv_load(const float* p, long long i) { return p[i]; }
__device__ __forceinline__ float kv_load(const bf16_t* p, long long i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void kv_store(float* p, long long i, float v) { p[i] = v; }
__device__ __forceinline__ void kv_store(bf16_t* p, long long i, float v) { p[i] = f32_to_bf16(v); }

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block; `scratch` holds 32 floats. Every thread gets the total.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int num_warps = (blockDim.x + 31) >> 5;
    float t = lane < num_warps ? scratch[lane] : 0.0f;
    return warp_sum(t);
}

__device__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int num_warps = (blockDim.x + 31) >> 5;
    float t = lane < num_warps ? scratch[lane] : NEG_INF;
    return warp_max(t);
}

extern "C" __global__ void f32_to_bf16_kernel(bf16_t* out, const float* in, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = f32_to_bf16(in[i]);
}

// out[t, :] = table[id, :] with id = ids[t], or — where `picked` is given and
// picked[t] != NOT_PICKED — the previous step's greedy pick picks[picked[t]], still on the
// device (zero-overhead scheduling without a host round trip).
#define NOT_PICKED 0xffffffffu
extern "C" __global__ void embedding_kernel(float* out, const bf16_t* table, const u32* ids,
                                            const u32* picked, const u32* picks, int dim) {
    int t = blockIdx.x;
    u32 id = ids[t];
    if (picked != 0 && picked[t] != NOT_PICKED) id = picks[picked[t]];
    const bf16_t* row = table + (long long)id * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) out[(long long)t * dim + d] = bf16_to_f32(row[d]);
}

extern "C" __global__ void add_bias_kernel(float* y, const float* bias, int rows, int cols) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < (long long)rows * cols) y[i] += bias[i % cols];
}

// One block per row: out = x / rms(x) * w.
extern "C" __global__ void rms_norm_kernel(float* out, const float* x, const float* w, float eps,
                                           int dim) {
    __shared__ float scratch[32];
    const float* xr = x + (long long)blockIdx.x * dim;
    float* o = out + (long long)blockIdx.x * dim;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) ss += xr[d] * xr[d];
    float inv = rsqrtf(block_sum(ss, scratch) / dim + eps);
    for (int d = threadIdx.x; d < dim; d += blockDim.x) o[d] = xr[d] * inv * w[d];
}

// residual += x; out = rms_norm(residual) * w.
extern "C" __global__ void add_rms_norm_kernel(float* residual, const float* x, const float* w,
                                               float eps, int dim, float* out) {
    __shared__ float scratch[32];
    float* r = residual + (long long)blockIdx.x * dim;
    const float* xr = x + (long long)blockIdx.x * dim;
    float* o = out + (long long)blockIdx.x * dim;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float v = r[d] + xr[d];
        r[d] = v;
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss, scratch) / dim + eps);
    for (int d = threadIdx.x; d < dim; d += blockDim.x) o[d] = r[d] * inv * w[d];
}

extern "C" __global__ void add_kernel(float* residual, const float* x, long long n) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) residual[i] += x[i];
}

// Rotate-half RoPE. cos_sin[pos, :half] = cos, [pos, half:] = sin. One block per row.
extern "C" __global__ void rope_kernel(float* x, const u32* positions, int num_heads,
                                       int head_dim, const float* cos_sin) {
    int half = head_dim / 2;
    int row = blockIdx.x;
    const float* table = cos_sin + (long long)positions[row] * head_dim;
    float* xr = x + (long long)row * num_heads * head_dim;
    for (int i = threadIdx.x; i < num_heads * half; i += blockDim.x) {
        int h = i / half, k = i % half;
        float* head = xr + h * head_dim;
        float x1 = head[k], x2 = head[k + half];
        float c = table[k], s = table[half + k];
        head[k] = x1 * c - x2 * s;
        head[k + half] = x2 * c + x1 * s;
    }
}

// out[r, i] = silu(gate_up[r, i]) * gate_up[r, width + i]
extern "C" __global__ void silu_mul_kernel(float* out, const float* gate_up, int rows, int width) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * width) return;
    long long r = i / width, c = i % width;
    float g = gate_up[r * 2 * width + c], u = gate_up[r * 2 * width + width + c];
    out[i] = g / (1.0f + expf(-g)) * u;
}

extern "C" __global__ void copy_columns_kernel(float* dst, const float* src, int src_width,
                                               int col_start, int width, int rows) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * width) return;
    long long r = i / width, c = i % width;
    dst[i] = src[r * src_width + col_start + c];
}

extern "C" __global__ void gather_rows_kernel(float* out, const float* x, const u32* rows,
                                              int width, int num_rows) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)num_rows * width) return;
    long long r = i / width, c = i % width;
    out[i] = x[(long long)rows[r] * width + c];
}

template <typename T>
__device__ void kv_write(T* k_cache, T* v_cache, const float* k, const float* v, const u32* slots,
                         int kv_dim, int num_tokens) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)num_tokens * kv_dim) return;
    long long t = i / kv_dim, d = i % kv_dim;
    if (slots[t] == PAD_SLOT) return;  // a padding row of a replayed decode graph
    long long dst = (long long)slots[t] * kv_dim + d;
    kv_store(k_cache, dst, k[i]);
    kv_store(v_cache, dst, v[i]);
}

extern "C" __global__ void kv_write_f32_kernel(float* k_cache, float* v_cache, const float* k,
                                               const float* v, const u32* slots, int kv_dim,
                                               int num_tokens) {
    kv_write(k_cache, v_cache, k, v, slots, kv_dim, num_tokens);
}

extern "C" __global__ void kv_write_bf16_kernel(bf16_t* k_cache, bf16_t* v_cache, const float* k,
                                                const float* v, const u32* slots, int kv_dim,
                                                int num_tokens) {
    kv_write(k_cache, v_cache, k, v, slots, kv_dim, num_tokens);
}

// Batch-invariant GEMM: C[m, n] = Σ_k X[m, k] · W[n, k], X f32, W bf16, C f32. Every output
// element is one thread's FMA chain over k in a fixed order (no split-K, zero padding adds
// exact zeros), so a row's result does not depend on how many rows share the launch —
// cuBLAS picks kernels by M and gives no such promise. 256 threads, 64×64 tiles, 4×4 each.
#define INV_TM 64
#define INV_TN 64
#define INV_TK 16
extern "C" __global__ void matmul_invariant_kernel(float* C, const float* X, const bf16_t* W,
                                                   int M, int N, int K) {
    __shared__ float xs[INV_TK][INV_TM + 1];
    __shared__ float ws[INV_TK][INV_TN + 1];
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int m0 = blockIdx.y * INV_TM, n0 = blockIdx.x * INV_TN;
    float acc[4][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < 4; ++j) acc[i][j] = 0.0f;
    for (int k0 = 0; k0 < K; k0 += INV_TK) {
        for (int i = threadIdx.x; i < INV_TM * INV_TK; i += blockDim.x) {
            int r = i / INV_TK, c = i % INV_TK;
            int gm = m0 + r, gk = k0 + c;
            xs[c][r] = (gm < M && gk < K) ? X[(long long)gm * K + gk] : 0.0f;
        }
        for (int i = threadIdx.x; i < INV_TN * INV_TK; i += blockDim.x) {
            int r = i / INV_TK, c = i % INV_TK;
            int gn = n0 + r, gk = k0 + c;
            ws[c][r] = (gn < N && gk < K) ? bf16_to_f32(W[(long long)gn * K + gk]) : 0.0f;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < INV_TK; ++kk) {
            float a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; ++i) a[i] = xs[kk][ty * 4 + i];
#pragma unroll
            for (int j = 0; j < 4; ++j) b[j] = ws[kk][tx * 4 + j];
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < 4; ++j) acc[i][j] = fmaf(a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        int gm = m0 + ty * 4 + i;
        if (gm >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            int gn = n0 + tx * 4 + j;
            if (gn < N) C[(long long)gm * N + gn] = acc[i][j];
        }
    }
}

__device__ __forceinline__ unsigned long long splitmix64(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

// --dummy-weights made on the device: element i = mean ± half_width from (seed, i), the same
// draw as the host's `random_weight`.
extern "C" __global__ void random_bf16_kernel(bf16_t* out, long long n, unsigned long long seed,
                                              float mean, float half_width) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned long long h = splitmix64(seed ^ splitmix64((unsigned long long)i));
    float u = (float)(h >> 40) / 16777216.0f;
    out[i] = f32_to_bf16(mean + (2.0f * u - 1.0f) * half_width);
}

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
template <typename T>
__device__ void attention_split(
    float* out, float* part_o, float* part_ml, const float* q, const T* k_cache,
    const T* v_cache, const u32* block_tables, const u32* row_table, const u32* row_visible,
    int num_heads, int num_kv_heads, int head_dim, int block_size, float scale, int num_splits) {
    __shared__ float q_s[256];
    __shared__ float p_s[ATT_CHUNK];
    __shared__ float scratch[32];
    int row = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
    u32 flagged = row_visible[row];
    if (flagged & FLASH_ROW) return;
    int visible = flagged;
    int num_chunks = (visible + ATT_CHUNK - 1) / ATT_CHUNK;
    int per_split = (num_chunks + num_splits - 1) / num_splits;
    int start = split * per_split * ATT_CHUNK;
    int end = min(visible, start + per_split * ATT_CHUNK);
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
                                    const u32* row_table, const u32* row_visible, int num_heads,  \
                                    int num_kv_heads, int head_dim, int block_size, float scale,  \
                                    int num_splits) {                                             \
        attention_split(out, part_o, part_ml, q, k_cache, v_cache, block_tables, row_table,      \
                        row_visible, num_heads, num_kv_heads, head_dim, block_size, scale,       \
                        num_splits);                                                             \
    }
SPLIT_ENTRY(attention_split_f32_kernel, float)
SPLIT_ENTRY(attention_split_bf16_kernel, bf16_t)

extern "C" __global__ void attention_combine_kernel(float* out, const float* part_o,
                                                    const float* part_ml, const u32* row_visible,
                                                    int num_heads, int head_dim, int num_splits) {
    int row = blockIdx.x, h = blockIdx.y;
    if (row_visible[row] & FLASH_ROW) return;  // flash_prefill_kernel's row
    long long base = ((long long)row * num_heads + h) * num_splits;
    float m = NEG_INF;
    for (int s = 0; s < num_splits; ++s) m = fmaxf(m, part_ml[2 * (base + s)]);
    float l = 0.0f;
    for (int s = 0; s < num_splits; ++s) {
        float ms = part_ml[2 * (base + s)];
        if (ms != NEG_INF) l += part_ml[2 * (base + s) + 1] * expf(ms - m);
    }
    float* o = out + ((long long)row * num_heads + h) * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < num_splits; ++s) {
            float ms = part_ml[2 * (base + s)];
            if (ms != NEG_INF) acc += part_o[(base + s) * head_dim + d] * expf(ms - m);
        }
        o[d] = l > 0.0f ? acc / l : 0.0f;  // a padding row sees no keys
    }
}

// Flash-style prefill attention: one block per (tile of up to FA_ROWS query rows of one
// sequence, head). The tile's queries stay in shared memory while the sequence's keys and
// values stream through it FA_KEYS at a time, so each key is read once per tile instead of
// once per query row; an online softmax per row folds the chunks in order (chunks start at
// key 0, so a row's result does not depend on its tile). Four threads per row: each scores
// every fourth key of a chunk and owns every fourth output dimension. Shared rows are
// padded by one float so the threads of a warp hit distinct banks.
// tiles[4·i ..] = (first query row, rows, block-table offset, position of the first row).
// Rows it handles are flagged in row_visible (FLASH_ROW) so the split kernel skips them.
// 256 threads; dynamic shared memory: fa_smem_floats(HD) floats.
#define FA_ROWS 64
#define FA_KEYS 32
template <int HD, typename T>
__device__ void flash_prefill(float* out, const float* q, const T* k_cache,
                              const T* v_cache, const u32* block_tables, const u32* tiles,
                              int num_heads, int num_kv_heads, int block_size, float scale) {
    extern __shared__ float fa_smem[];
    const int QS = HD + 1, PS = FA_KEYS + 1, DIMS = HD / 4;
    float* q_s = fa_smem;                  // [FA_ROWS][QS]
    float* k_s = q_s + FA_ROWS * QS;       // [FA_KEYS][QS]
    float* v_s = k_s + FA_KEYS * QS;       // [FA_KEYS][HD]
    float* p_s = v_s + FA_KEYS * HD;       // [FA_ROWS][PS]
    const u32* tile = tiles + 4 * blockIdx.x;
    int first_row = tile[0], num_rows = tile[1];
    const u32* table = block_tables + tile[2];
    int first_pos = tile[3];
    int h = blockIdx.y, kvh = h / (num_heads / num_kv_heads);
    int kv_dim = num_kv_heads * HD;
    int r = threadIdx.x >> 2, quad = threadIdx.x & 3;
    for (int i = threadIdx.x; i < FA_ROWS * HD; i += blockDim.x) {
        int row = i / HD, d = i % HD;
        q_s[row * QS + d] =
            row < num_rows ? q[((long long)(first_row + row) * num_heads + h) * HD + d] * scale : 0.0f;
    }
    int visible = first_pos + r + 1;  // keys row r may see
    int num_keys = first_pos + num_rows;
    float m = NEG_INF, l = 0.0f;
    float acc[DIMS];
#pragma unroll
    for (int i = 0; i < DIMS; ++i) acc[i] = 0.0f;
    for (int c0 = 0; c0 < num_keys; c0 += FA_KEYS) {
        int n = min(FA_KEYS, num_keys - c0);
        __syncthreads();  // the previous chunk's k_s / v_s are consumed
        for (int i = threadIdx.x; i < FA_KEYS * HD; i += blockDim.x) {
            int j = i / HD, d = i % HD;
            float kk = 0.0f, vv = 0.0f;
            if (j < n) {
                int key = c0 + j;
                long long slot = (long long)table[key / block_size] * block_size + key % block_size;
                long long at = slot * kv_dim + kvh * HD + d;
                kk = kv_load(k_cache, at);
                vv = kv_load(v_cache, at);
            }
            k_s[j * QS + d] = kk;
            v_s[j * HD + d] = vv;
        }
        __syncthreads();
        float s[FA_KEYS / 4];
        float local_max = NEG_INF;
        const float* qr = q_s + r * QS;
#pragma unroll
        for (int t = 0; t < FA_KEYS / 4; ++t) {
            int j = quad + 4 * t;
            const float* kr = k_s + j * QS;
            float dot = 0.0f;
#pragma unroll 16
            for (int d = 0; d < HD; ++d) dot += qr[d] * kr[d];
            s[t] = (j < n && c0 + j < visible) ? dot : NEG_INF;
            local_max = fmaxf(local_max, s[t]);
        }
        local_max = fmaxf(local_max, __shfl_xor_sync(0xffffffffu, local_max, 1));
        local_max = fmaxf(local_max, __shfl_xor_sync(0xffffffffu, local_max, 2));
        // Key 0 lies in the first chunk and every row sees it: m_new is finite.
        float m_new = fmaxf(m, local_max);
        float local_sum = 0.0f;
        float* pr = p_s + r * PS;
#pragma unroll
        for (int t = 0; t < FA_KEYS / 4; ++t) {
            float p = s[t] == NEG_INF ? 0.0f : expf(s[t] - m_new);
            pr[quad + 4 * t] = p;
            local_sum += p;
        }
        local_sum += __shfl_xor_sync(0xffffffffu, local_sum, 1);
        local_sum += __shfl_xor_sync(0xffffffffu, local_sum, 2);
        float alpha = expf(m - m_new);  // 0 on the first chunk: m is −∞
        l = l * alpha + local_sum;
        m = m_new;
        __syncwarp();  // the row's four threads share pr
#pragma unroll
        for (int i = 0; i < DIMS; ++i) acc[i] *= alpha;
        for (int j = 0; j < n; ++j) {
            float p = pr[j];
            const float* vr = v_s + j * HD + quad;
#pragma unroll
            for (int i = 0; i < DIMS; ++i) acc[i] += p * vr[4 * i];
        }
    }
    if (r >= num_rows) return;
    float* o = out + ((long long)(first_row + r) * num_heads + h) * HD;
#pragma unroll
    for (int i = 0; i < DIMS; ++i) o[quad + 4 * i] = acc[i] / l;
}

#define FLASH_ENTRY(NAME, HD, T)                                                              \
    extern "C" __global__ void NAME(float* out, const float* q, const T* k_cache,               \
                                    const T* v_cache, const u32* block_tables, const u32* tiles, \
                                    int num_heads, int num_kv_heads, int block_size,            \
                                    float scale) {                                              \
        flash_prefill<HD, T>(out, q, k_cache, v_cache, block_tables, tiles, num_heads,          \
                             num_kv_heads, block_size, scale);                                  \
    }
FLASH_ENTRY(flash_prefill_64_f32_kernel, 64, float)
FLASH_ENTRY(flash_prefill_128_f32_kernel, 128, float)
FLASH_ENTRY(flash_prefill_64_bf16_kernel, 64, bf16_t)
FLASH_ENTRY(flash_prefill_128_bf16_kernel, 128, bf16_t)
