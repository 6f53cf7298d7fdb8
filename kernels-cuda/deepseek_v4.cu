// troupe's CUDA kernels for DeepSeek-V4's own operations (the GEMMs go through the Llama
// program's GEMV / cuBLAS paths): interleaved partial RoPE, mHC mixing with Sinkhorn
// iterations, the compressors' window state machine, the lightning indexer and its top-k,
// sliding-window + compressed attention with sinks, MoE routing and the clipped SwiGLU.
// Every kernel mirrors a function of the f32 host reference (`model/deepseek_v4/`), in the
// same order of operations where that order is cheap to keep.
//
// Metadata: `rows` is [T][2] = (sequence index, position); `seqs` is [S][SEQ_FIELDS] as
// below; `block_tables` holds every sequence's table, `S_BT` its offset.

#define NEG_INF (__int_as_float(0xff800000))
typedef unsigned int u32;

#define SEQ_FIELDS 8
#define S_SLOT 0
#define S_POS0 1
#define S_ROW0 2
#define S_LEN 3
#define S_START 4
#define S_REPLAY 5
#define S_BT 6

__device__ __forceinline__ float ds_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

__device__ __forceinline__ float ds_warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float ds_warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block (blockDim a multiple of 32); every thread gets it.
__device__ float ds_block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = ds_warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : 0.0f;
    return ds_warp_sum(t);
}

__device__ float ds_block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    v = ds_warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    float t = lane < warps ? scratch[lane] : NEG_INF;
    return ds_warp_max(t);
}

// Where compressed entry `e` (source tokens e·rate ..) of a sequence lives, in entries.
__device__ __forceinline__ long long ds_entry(const u32* table, int block_size, int rate, int epb,
                                              int e) {
    int first = e * rate;  // positions fit in 31 bits; 32-bit division is the cheap one
    long long block = table[first / block_size];
    return block * epb + (first % block_size) / rate;
}

// Rotates the trailing 2·half channels of each dim-wide row (rows · heads of them) in
// consecutive pairs at the row's position; sign −1 undoes it (`ops::rope_rows`).
extern "C" __global__ void dsv4_rope_kernel(float* x, const u32* rows, int num_rows, int heads,
                                            int dim, int half, const float* freqs, float sign) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)num_rows * heads * half) return;
    int p = (int)(i % half);
    long long rh = i / half;
    int r = (int)(rh / heads);
    float angle = (float)rows[2 * r + 1] * freqs[p];
    float c = cosf(angle), s = sign * sinf(angle);
    float* pair = x + rh * dim + dim - 2 * half + 2 * p;
    float a = pair[0], b = pair[1];
    pair[0] = a * c - b * s;
    pair[1] = b * c + a * s;
}

// Per token: mHC's pre, post and Sinkhorn-projected comb weights from its mixes
// [(2 + n)·n], and the collapse Σ_j pre_j · stream_j (`mhc::mix`). Blocks split the
// token's channels (grid.y is the token); the first also runs the Sinkhorn iterations, a
// thread per comb entry with each row's and column's sums taken in the serial order —
// exchanged by shuffles inside one warp when n·n ≤ 32 (no barrier an iteration), else
// through shared memory. (A thread alone running the iterations took 60 µs a token; one
// block a token running them and the whole collapse, 22 µs.)
extern "C" __global__ void dsv4_mhc_mix_kernel(const float* mixes, const float* streams,
                                               const float* base, const float* scale, float* post,
                                               float* comb, float* collapsed, int n, int hidden,
                                               int iters, float hc_eps) {
    __shared__ float pre_s[16];
    __shared__ float c[16 * 16];
    int t = blockIdx.y, i = threadIdx.x, nn = n * n;
    int row = i / n, col = i % n;
    const float* m = mixes + (long long)t * (2 + n) * n;
    if (i < n) pre_s[i] = ds_sigmoid(m[i] * scale[0] + base[i]) + hc_eps;
    if (blockIdx.x == 0) {
        if (i < n) post[t * n + i] = 2.0f * ds_sigmoid(m[n + i] * scale[1] + base[n + i]);
        float v = 0.0f;
        if (i < nn) {
            const float* logit = m + 2 * n + row * n;
            const float* b = base + 2 * n + row * n;
            float mx = NEG_INF;
#pragma unroll 4
            for (int k = 0; k < n; ++k) mx = fmaxf(mx, logit[k] * scale[2] + b[k]);
            float sum = 0.0f;
#pragma unroll 4
            for (int k = 0; k < n; ++k) sum += expf(logit[k] * scale[2] + b[k] - mx);
            v = expf(logit[col] * scale[2] + b[col] - mx) / sum + hc_eps;
        }
        if (nn <= 32) {
            if (i < 32) {
                for (int it = 0; it < iters; ++it) {
                    float sum = 0.0f;
                    if (it > 0) {
#pragma unroll 4
                        for (int k = 0; k < n; ++k)
                            sum += __shfl_sync(0xffffffffu, v, (row * n + k) & 31);
                        v /= sum + hc_eps;
                    }
                    sum = 0.0f;
#pragma unroll 4
                    for (int j = 0; j < n; ++j)
                        sum += __shfl_sync(0xffffffffu, v, (j * n + col) & 31);
                    v /= sum + hc_eps;
                }
                if (i < nn) comb[(long long)t * nn + i] = v;
            }
        } else {
            if (i < nn) c[i] = v;
            __syncthreads();
            for (int it = 0; it < iters; ++it) {
                float sum = 0.0f;
                if (it > 0) {
                    if (i < nn) {
                        for (int k = 0; k < n; ++k) sum += c[row * n + k];
                        sum += hc_eps;
                    }
                    __syncthreads();
                    if (i < nn) c[i] /= sum;
                    __syncthreads();
                }
                sum = 0.0f;
                if (i < nn) {
                    for (int j = 0; j < n; ++j) sum += c[j * n + col];
                    sum += hc_eps;
                }
                __syncthreads();
                if (i < nn) c[i] /= sum;
                __syncthreads();
            }
            if (i < nn) comb[(long long)t * nn + i] = c[i];
        }
    }
    __syncthreads();
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= hidden) return;
    float acc = 0.0f;
#pragma unroll 4
    for (int j = 0; j < n; ++j) acc += pre_s[j] * streams[((long long)t * n + j) * hidden + ch];
    collapsed[(long long)t * hidden + ch] = acc;
}

// streams[k] ← post[k] · out + Σ_j comb[j][k] · streams[j], per token (`mhc::merge`).
extern "C" __global__ void dsv4_mhc_merge_kernel(float* streams, const float* post,
                                                 const float* comb, const float* out, int n,
                                                 int hidden) {
    // Blocks split a token's channels (grid.y is the token); the streams stay in registers.
    int t = blockIdx.y;
    const float* c = comb + (long long)t * n * n;
    int ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= hidden) return;
    float s[16];
#pragma unroll
    for (int j = 0; j < 16; ++j)
        if (j < n) s[j] = streams[((long long)t * n + j) * hidden + ch];
    float o = out[(long long)t * hidden + ch];
#pragma unroll
    for (int k = 0; k < 16; ++k) {
        if (k >= n) break;
        float v = post[t * n + k] * o;
#pragma unroll
        for (int j = 0; j < 16; ++j)
            if (j < n) v += c[j * n + k] * s[j];
        streams[((long long)t * n + k) * hidden + ch] = v;
    }
}

// The head's collapse: pre weights only, from mixes [n] (`mhc::head`).
extern "C" __global__ void dsv4_mhc_head_kernel(const float* mixes, const float* streams,
                                                const float* base, const float* scale, float* out,
                                                int n, int hidden, float hc_eps) {
    // Blocks split the token's channels (grid.y is the token).
    int t = blockIdx.y, ch = blockIdx.x * blockDim.x + threadIdx.x;
    if (ch >= hidden) return;
    float acc = 0.0f;
    for (int j = 0; j < n; ++j) {
        float pre = ds_sigmoid(mixes[t * n + j] * scale[0] + base[j]) + hc_eps;
        acc += pre * streams[((long long)t * n + j) * hidden + ch];
    }
    out[(long long)t * hidden + ch] = acc;
}

// A step's ids where rows continue from the last step's picks still on the device (ZOS):
// ids[t] = picks[picked[t]] unless picked[t] is NOT_PICKED (all ones).
extern "C" __global__ void dsv4_take_picks_kernel(u32* ids, const u32* picked, const u32* picks,
                                                  int tokens) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < tokens && picked[t] != 0xffffffffu) ids[t] = picks[picked[t]];
}

// out[t] = table[ids[t]]: the f32 embedding, rows chosen by ids on the device.
extern "C" __global__ void __launch_bounds__(1024)
    dsv4_embed_kernel(float* out, const float* table, const u32* ids, int dim) {
    int t = blockIdx.x;
    const float* row = table + (long long)ids[t] * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) out[(long long)t * dim + d] = row[d];
}

// [T, hidden] → [T, n, hidden]: every stream starts as the token's embedding.
extern "C" __global__ void dsv4_expand_kernel(float* streams, const float* x, int tokens, int n,
                                              int hidden) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)tokens * n * hidden) return;
    long long t = i / ((long long)n * hidden);
    streams[i] = x[t * hidden + i % hidden];
}

// x [a, b, width] → y [b, a, width] (the grouped output projection's per-group operands).
extern "C" __global__ void dsv4_swap_kernel(float* y, const float* x, int a, int b, int width) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)a * b * width) return;
    int c = (int)(i % width);
    long long ab = i / width;
    int ia = (int)(ab / b), ib = (int)(ab % b);
    y[((long long)ib * a + ia) * width + c] = x[i];
}

// A compressor fed a chunk [pos0, end) of a sequence (`CompressorCache::feed`): every
// window the chunk closes emits one entry — a softmax over the window's gate logits
// (+ position bias; with overlap, over the previous window's Ca half and this window's Cb
// half) weighting its kv rows — unless the window is a cached prefix being replayed (norm
// and RoPE come after, in dsv4_entry_finish_kernel); then the slot keeps the open window's
// rows and the last closed window's Ca half. The windows are independent, so the emits run
// a thread per (window, channel) (a thread a channel walking 4 096 rows in order took
// 6.7 ms a layer) and the state is written after, by dsv4_compress_keep_kernel. A row at
// position p is the chunk's own (p ≥ pos0), the slot's open window's (buf: the window open
// at pos0), or the Ca half kept from the window closed before the chunk (prev, gate with
// its bias).
struct DsCompressRows {
    const float *kv, *gate, *bias, *bkv, *bgate, *pkv, *pgate;
    int pos0, row0, open0, rate, width, dim;
    __device__ float kv_at(int p, int col) const {
        return p >= pos0 ? kv[(long long)(row0 + p - pos0) * width + col] : bkv[(p % rate) * width + col];
    }
    // The gate logit plus its position's bias (`pgate` holds that sum already).
    __device__ float gate_at(int p, int col) const {
        float g = p >= pos0 ? gate[(long long)(row0 + p - pos0) * width + col] : bgate[(p % rate) * width + col];
        return g + bias[(p % rate) * width + col];
    }
    // Column c of the Ca half of the window before the one at w0 (positions w0 − rate + j).
    __device__ float prev_kv_at(int w0, int j, int c) const {
        int p = w0 - rate + j;
        return p >= open0 ? kv_at(p, c) : pkv[j * dim + c];
    }
    __device__ float prev_gate_at(int w0, int j, int c) const {
        int p = w0 - rate + j;
        return p >= open0 ? gate_at(p, c) : pgate[j * dim + c];
    }
};

__device__ __forceinline__ DsCompressRows ds_compress_rows(const u32* sq, const float* kv, const float* gate,
                                                          const float* bias, const float* buf_kv,
                                                          const float* buf_gate, const float* prev_kv,
                                                          const float* prev_gate, int rate, int width,
                                                          int dim) {
    long long slot = sq[S_SLOT];
    int pos0 = sq[S_POS0];
    return DsCompressRows{kv, gate, bias, buf_kv + slot * rate * width, buf_gate + slot * rate * width,
                          prev_kv + slot * rate * dim, prev_gate + slot * rate * dim, pos0, (int)sq[S_ROW0],
                          pos0 / rate * rate, rate, width, dim};
}

// Grid: (channel blocks, sequences, windows a chunk closes at most); a thread a (window,
// channel c), in the order of operations of the walk it replaces.
extern "C" __global__ void dsv4_compress_feed_kernel(
    const float* kv, const float* gate, const float* bias, const float* buf_kv, const float* buf_gate,
    const float* prev_kv, const float* prev_gate, float* entries, const u32* seqs, const u32* block_tables,
    int block_size, int rate, int width, int dim, int overlap, int epb) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= dim) return;
    const u32* sq = seqs + blockIdx.y * SEQ_FIELDS;
    int pos0 = sq[S_POS0], end = pos0 + (int)sq[S_LEN];
    int start = sq[S_START], replay = sq[S_REPLAY];
    int w = pos0 / rate + blockIdx.z;
    // Closed by the chunk (its last row before end), and not a replayed prefix's.
    if ((w + 1) * rate > end || (w + 1) * rate <= replay) return;
    DsCompressRows r = ds_compress_rows(sq, kv, gate, bias, buf_kv, buf_gate, prev_kv, prev_gate, rate, width, dim);
    int w0 = w * rate, cb = overlap ? dim : 0;
    bool has_prev = overlap && w0 > start;
    float mx = NEG_INF;
    if (has_prev)
        for (int j = 0; j < rate; ++j) mx = fmaxf(mx, r.prev_gate_at(w0, j, c));
    for (int j = 0; j < rate; ++j) mx = fmaxf(mx, r.gate_at(w0 + j, cb + c));
    float sum = 0.0f;
    if (has_prev)
        for (int j = 0; j < rate; ++j) sum += expf(r.prev_gate_at(w0, j, c) - mx);
    for (int j = 0; j < rate; ++j) sum += expf(r.gate_at(w0 + j, cb + c) - mx);
    float acc = 0.0f;
    if (has_prev)
        for (int j = 0; j < rate; ++j) acc += expf(r.prev_gate_at(w0, j, c) - mx) / sum * r.prev_kv_at(w0, j, c);
    for (int j = 0; j < rate; ++j) acc += expf(r.gate_at(w0 + j, cb + c) - mx) / sum * r.kv_at(w0 + j, cb + c);
    const u32* table = block_tables + sq[S_BT];
    entries[ds_entry(table, block_size, rate, epb, w) * dim + c] = acc;
}

// After the emits: the slot's state as the chunk leaves it — per window slot s the last
// row at a position ≡ s (mod rate) (the open window's rows, and the closed one's where the
// chunk wrote no later row, as the walk left them), and with overlap the Ca half of the
// last window the chunk closed (read before the rows it may take from buf are replaced).
// A thread a (sequence, channel c), writing only its columns (c, dim + c).
extern "C" __global__ void dsv4_compress_keep_kernel(
    const float* kv, const float* gate, const float* bias, float* buf_kv, float* buf_gate,
    float* prev_kv, float* prev_gate, const u32* seqs, int rate, int width, int dim, int overlap) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= dim) return;
    const u32* sq = seqs + blockIdx.y * SEQ_FIELDS;
    int len = sq[S_LEN];
    if (len == 0) return;
    DsCompressRows r = ds_compress_rows(sq, kv, gate, bias, buf_kv, buf_gate, prev_kv, prev_gate, rate, width, dim);
    int pos0 = r.pos0, end = pos0 + len;
    long long slot = sq[S_SLOT];
    float* bkv = buf_kv + slot * rate * width;
    float* bgate = buf_gate + slot * rate * width;
    int wl = end / rate - 1;
    if (overlap && wl >= 0 && (wl + 1) * rate > pos0) {
        float* pkv = prev_kv + slot * rate * dim;
        float* pgate = prev_gate + slot * rate * dim;
        for (int j = 0; j < rate; ++j) {
            float v = r.kv_at(wl * rate + j, c), g = r.gate_at(wl * rate + j, c);
            pkv[j * dim + c] = v;
            pgate[j * dim + c] = g;
        }
    }
    for (int s = 0; s < rate; ++s) {
        if (end - 1 < s) continue;
        int p = s + (end - 1 - s) / rate * rate;
        if (p < pos0) continue;
        long long src = (long long)(r.row0 + p - pos0) * width;
        bkv[s * width + c] = kv[src + c];
        bgate[s * width + c] = gate[src + c];
        if (overlap) {
            bkv[s * width + dim + c] = kv[src + dim + c];
            bgate[s * width + dim + c] = gate[src + dim + c];
        }
    }
}

// The entries emitted this step, [E][2] = (entry index, position of its first token),
// NO_ENTRY entries skipped:
// RMS norm with `norm`, then RoPE at that position. One block an entry.
extern "C" __global__ void dsv4_entry_finish_kernel(float* entries, const u32* emits, int dim,
                                                    const float* norm, float eps,
                                                    const float* freqs, int half) {
    __shared__ float scratch[32];
    if (emits[2 * blockIdx.x] == 0xffffffffu) return;  // NO_ENTRY: a recorded step's padding
    float* e = entries + (long long)emits[2 * blockIdx.x] * dim;
    float pos = (float)emits[2 * blockIdx.x + 1];
    float ss = 0.0f;
    for (int c = threadIdx.x; c < dim; c += blockDim.x) ss += e[c] * e[c];
    float inv = 1.0f / sqrtf(ds_block_sum(ss, scratch) / dim + eps);
    for (int c = threadIdx.x; c < dim; c += blockDim.x) e[c] = norm[c] * (e[c] * inv);
    __syncthreads();
    for (int p = threadIdx.x; p < half; p += blockDim.x) {
        float angle = pos * freqs[p];
        float cs = cosf(angle), sn = sinf(angle);
        float* pair = e + dim - 2 * half + 2 * p;
        float a = pair[0], b = pair[1];
        pair[0] = a * cs - b * sn;
        pair[1] = b * cs + a * sn;
    }
}

// The lightning indexer's score of every visible entry for every row:
// Σ_h w_h · relu(q_h · k) (scaled), −∞ past the row's visible entries. A block takes a row
// and IX_ENTRIES entries, the row's queries and the entries' keys in shared memory: a lane
// an entry, a warp every 8th head, so no product waits on a reduction (a warp an entry
// summing each head's dot by shuffles took 160 µs for one V4-Flash row), and the warps'
// partial sums added in warp order. dim is a multiple of 4 (checked at load): 4 floats a
// load, keys' rows padded by 4 floats so a quarter-warp's loads hit distinct banks.
#define IX_ENTRIES 32
#define IX_WARPS 8
#define IX_HEADS 8
extern "C" __global__ void __launch_bounds__(256) dsv4_index_scores_kernel(
    float* scores, const float* q, const float* head_weights, const float* keys, const u32* rows,
    const u32* seqs, const u32* block_tables, int block_size, int rate, int epb, int heads,
    int dim, float score_scale, float weight_scale, int max_visible) {
    extern __shared__ __align__(16) float ix_smem[];
    __shared__ float part[IX_WARPS][IX_ENTRIES];
    int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int visible = ((int)rows[2 * r + 1] + 1) / rate;
    int e0 = blockIdx.y * IX_ENTRIES;
    int count = min(IX_ENTRIES, max_visible - e0);
    if (e0 >= visible) {
        if (threadIdx.x < count) scores[(long long)r * max_visible + e0 + threadIdx.x] = NEG_INF;
        return;
    }
    int stride = dim + 4;
    float* qs = ix_smem;
    float* ks = ix_smem + heads * dim;
    // The loads unrolled so that they are all in flight: a loop of one load a trip waits
    // out the memory latency each time (half this kernel's time, measured).
    const float4* qr = (const float4*)(q + (long long)r * heads * dim);
#pragma unroll 8
    for (int i = threadIdx.x; i < heads * dim / 4; i += blockDim.x) ((float4*)qs)[i] = qr[i];
    const u32* table = block_tables + seqs[rows[2 * r] * SEQ_FIELDS + S_BT];
    int live = min(count, visible - e0);
    // A warp a key row at a time, its lanes along the row.
#pragma unroll 4
    for (int j = warp; j < live; j += IX_WARPS) {
        const float* k = keys + ds_entry(table, block_size, rate, epb, e0 + j) * dim;
        for (int c = 4 * lane; c < dim; c += 128)
            *(float4*)&ks[j * stride + c] = *(const float4*)&k[c];
    }
    __syncthreads();
    float s = 0.0f;
    if (lane < live) {
        const float* k = ks + lane * stride;
        for (int h0 = warp; h0 < heads; h0 += IX_WARPS * IX_HEADS) {
            float d[IX_HEADS];
#pragma unroll
            for (int j = 0; j < IX_HEADS; ++j) d[j] = 0.0f;
            for (int c = 0; c < dim; c += 4) {
                float4 kv = *(const float4*)&k[c];
#pragma unroll
                for (int j = 0; j < IX_HEADS; ++j) {
                    int h = h0 + IX_WARPS * j;
                    if (h >= heads) break;
                    float4 qv = *(const float4*)&qs[h * dim + c];
                    d[j] = fmaf(qv.x, kv.x, d[j]);
                    d[j] = fmaf(qv.y, kv.y, d[j]);
                    d[j] = fmaf(qv.z, kv.z, d[j]);
                    d[j] = fmaf(qv.w, kv.w, d[j]);
                }
            }
#pragma unroll
            for (int j = 0; j < IX_HEADS; ++j) {
                int h = h0 + IX_WARPS * j;
                if (h >= heads) break;
                s += fmaxf(d[j], 0.0f) * score_scale * head_weights[r * heads + h] * weight_scale;
            }
        }
    }
    part[warp][lane] = s;
    __syncthreads();
    if (threadIdx.x >= count) return;
    int e = e0 + threadIdx.x;
    float total = NEG_INF;
    if (e < visible) {
        total = 0.0f;
#pragma unroll
        for (int w = 0; w < IX_WARPS; ++w) total += part[w][threadIdx.x];
    }
    scores[(long long)r * max_visible + e] = total;
}

// The ring keeps each chunk's last min(len, ring_len) K=V rows, at position % ring_len.
extern "C" __global__ void dsv4_ring_write_kernel(float* ring, const float* kv, const u32* seqs,
                                                  int ring_len, int hd) {
    const u32* sq = seqs + blockIdx.y * SEQ_FIELDS;
    long long slot = sq[S_SLOT];
    int pos0 = sq[S_POS0], row0 = sq[S_ROW0], len = sq[S_LEN];
    int keep = min(len, ring_len);
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)keep * hd) return;
    int row = len - keep + (int)(i / hd);
    int c = (int)(i % hd);
    int p = pos0 + row;
    ring[(slot * ring_len + p % ring_len) * hd + c] = kv[(long long)(row0 + row) * hd + c];
}

// Per token: router scores (0 sqrtsoftplus, 1 sigmoid, 2 softmax), the k experts (the
// hash table's when given, else torch.topk of score + bias, unsorted, tie for tie) and
// their weights, normalised and scaled (`moe::moe`). One block a token; E ≤ 1024.
extern "C" __global__ void dsv4_moe_route_kernel(u32* chosen, float* weights, const float* logits,
                                                 const u32* token_ids, const u32* tid2eid,
                                                 const float* bias, int scoring, int num_experts,
                                                 int k, float scaling) {
    __shared__ float s[1024];
    int t = blockIdx.x;
    const float* l = logits + (long long)t * num_experts;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
        float x = l[e];
        if (scoring == 0) {
            float sp = x > 20.0f ? x : log1pf(expf(x));
            s[e] = sqrtf(sp);
        } else if (scoring == 1) {
            s[e] = ds_sigmoid(x);
        } else {
            s[e] = x;
        }
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    if (scoring == 2) {
        float mx = NEG_INF;
        for (int e = 0; e < num_experts; ++e) mx = fmaxf(mx, s[e]);
        float sum = 0.0f;
        for (int e = 0; e < num_experts; ++e) {
            s[e] = expf(s[e] - mx);
            sum += s[e];
        }
        for (int e = 0; e < num_experts; ++e) s[e] /= sum;
    }
    u32 picked[32];
    if (tid2eid != 0) {
        for (int j = 0; j < k; ++j) picked[j] = tid2eid[(long long)token_ids[t] * k + j];
    } else {
        __shared__ float tv[1024];
        __shared__ int tx[1024];
        for (int e = 0; e < num_experts; ++e) {
            tv[e] = bias != 0 ? s[e] + bias[e] : s[e];
            tx[e] = e;
        }
        tk_select(tv, tx, num_experts, k);
        for (int j = 0; j < k; ++j) picked[j] = (u32)tx[j];
    }
    float total = 0.0f;
    for (int j = 0; j < k; ++j) total += s[picked[j]];
    total += 1e-20f;
    for (int j = 0; j < k; ++j) {
        chosen[t * k + j] = picked[j];
        weights[t * k + j] = s[picked[j]] / total * scaling;
    }
}

// h = silu(min(gate, limit)) · clamp(up, −limit, limit).
extern "C" __global__ void dsv4_swiglu_kernel(float* h, const float* gate, const float* up,
                                              long long n, float limit) {
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = fminf(gate[i], limit);
    float u = fminf(fmaxf(up[i], -limit), limit);
    h[i] = g * ds_sigmoid(g) * u;
}

