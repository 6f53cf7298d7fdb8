// DeepSeek-V4's attention (appended to `deepseek_v4.cu`, whose helpers and metadata it
// uses): shared-KV attention with sinks over the window and the compressed entries, and the
// merge of its splits.

// A row's keys (both attention kernels): the window's positions lo ..= t (ring rows before
// the chunk, the chunk's own after), then n_comp compressed entries (the indexer's
// selection when `sel` is given, else every closed window; none when rate is 0).
struct DsAttKeys {
    const float *kv, *ring, *entries;
    const int* sel;
    const u32* table;
    long long slot, sel_at;
    int pos0, row0, lo, n_swa, n_comp, hd, ring_len, rate, block_size, epb;
    __device__ const float* key(int i) const {
        if (i < n_swa) {
            int p = lo + i;
            return p < pos0 ? ring + (slot * ring_len + p % ring_len) * hd : kv + (long long)(row0 + p - pos0) * hd;
        }
        int e = sel != 0 ? sel[sel_at + i - n_swa] : i - n_swa;
        return entries + ds_entry(table, block_size, rate, epb, e) * hd;
    }
};

__device__ __forceinline__ DsAttKeys ds_att_keys(int r, const u32* rows, const u32* seqs, const u32* block_tables,
                                                 const float* kv, const float* ring, const float* entries,
                                                 const int* sel, int sel_k, int hd, int window, int ring_len,
                                                 int rate, int block_size, int epb) {
    int t = rows[2 * r + 1];
    const u32* sq = seqs + rows[2 * r] * SEQ_FIELDS;
    int start = sq[S_START];
    int lo = t + 1 - window;
    if (lo < start) lo = start;
    int n_comp = 0;
    if (rate > 0) {
        int visible = (t + 1) / rate;
        n_comp = sel != 0 ? min(visible, sel_k) : visible;
    }
    return DsAttKeys{kv, ring, entries, sel, block_tables + sq[S_BT], (long long)sq[S_SLOT], (long long)r * sel_k,
                     (int)sq[S_POS0], (int)sq[S_ROW0], lo, t - lo + 1, n_comp, hd, ring_len, rate, block_size, epb};
}

// Shared-KV attention with sinks over the sliding window (ring rows before the chunk, the
// chunk's own rows after) and the compressed entries (the indexer's selection when `sel`
// is given, else every closed window; none when rate is 0) (`attention::attention`,
// before the output's RoPE is undone). All heads read the same keys, so one block takes
// one row and `hg` heads (grid: rows × heads / hg): it loads each tile of ATT_KT keys into
// shared memory once for all its heads and keeps an online softmax per head, started at
// the head's sink. Dynamic shared memory: ATT_SMEM_FLOATS(hd).
#define ATT_KT 16
#define ATT_HG 16
#define ATT_CPT 4
#define ATT_SMEM_FLOATS(hd) ((ATT_HG + ATT_KT) * ((hd) + 1) + ATT_HG * ATT_KT + 2 * ATT_HG)
// Two blocks an SM: left to itself ptxas gives the split version 150 registers, one block.
extern "C" __global__ void __launch_bounds__(256, 2) dsv4_attention_kernel(
    float* out, const float* q, const float* kv, const float* ring, const float* entries,
    const int* sel, int sel_k, const u32* rows, const u32* seqs, const u32* block_tables,
    const float* sinks, int heads, int hd, int window, int ring_len, int rate, int block_size,
    int epb, float scale, int hg, int splits, int split_keys, float* part) {
    extern __shared__ float smem[];
    __shared__ const float* kptr[ATT_KT];
    int stride = hd + 1;  // padded rows: a warp's 16 keys at one channel hit 16 banks
    float* qs = smem;
    float* ks = qs + ATT_HG * stride;
    float* ps = ks + ATT_KT * stride;
    float* m_s = ps + ATT_HG * ATT_KT;
    float* rescale = m_s + ATT_HG;
    int r = blockIdx.x, h0 = blockIdx.y * hg;
    DsAttKeys keys = ds_att_keys(r, rows, seqs, block_tables, kv, ring, entries, sel, sel_k, hd, window, ring_len,
                                 rate, block_size, epb);
    int nk = keys.n_swa + keys.n_comp;
    // Split z of the row's splits takes its share of the keys, in whole tiles; the first
    // holds the sink. With split_keys (the batch-invariant mode) the row's own key count
    // sets how many of the `splits` it uses — one a split_keys keys — so that its sums are
    // the same whatever the batch; the rest hold no keys (a max of −∞, a total of 0: the
    // merge passes over them) and stop here.
    int z = blockIdx.z;
    int used = split_keys > 0 ? min(splits, max(1, (nk + split_keys - 1) / split_keys)) : splits;
    if (z >= used) {
        long long n_parts = (long long)gridDim.x * heads * splits;
        for (int h = threadIdx.x; h < hg && h0 + h < heads; h += blockDim.x) {
            long long at = ((long long)r * heads + h0 + h) * splits + z;
            part[n_parts * hd + 2 * at] = NEG_INF;
            part[n_parts * hd + 2 * at + 1] = 0.0f;
        }
        return;
    }
    for (int i = threadIdx.x; i < hg * hd; i += blockDim.x) {
        int h = i / hd, c = i % hd;
        qs[h * stride + c] = h0 + h < heads ? q[((long long)r * heads + h0 + h) * hd + c] : 0.0f;
    }
    int per = (nk + used - 1) / used;
    per = (per + ATT_KT - 1) / ATT_KT * ATT_KT;
    int k_lo = z * per, k_hi = min(nk, k_lo + per);
    if (threadIdx.x < hg) {
        m_s[threadIdx.x] = z > 0 ? NEG_INF : h0 + threadIdx.x < heads ? sinks[h0 + threadIdx.x] : 0.0f;
    }
    // Per head: the running sum (the sink's own term, exp(0), to start) and the output
    // channels this thread owns (c = threadIdx.x + j·blockDim.x).
    float l_run = z > 0 ? 0.0f : 1.0f;
    float acc[ATT_HG][ATT_CPT];
    for (int h = 0; h < ATT_HG; ++h)
        for (int j = 0; j < ATT_CPT; ++j) acc[h][j] = 0.0f;
    for (int k0 = k_lo; k0 < k_hi; k0 += ATT_KT) {
        int kt = min(ATT_KT, k_hi - k0);
        __syncthreads();
        // Each key's address once, then the tile copied row by row.
        if (threadIdx.x < kt) kptr[threadIdx.x] = keys.key(k0 + threadIdx.x);
        __syncthreads();
        for (int j = 0; j < kt; ++j)
            for (int c = threadIdx.x; c < hd; c += blockDim.x) ks[j * stride + c] = kptr[j][c];
        __syncthreads();
        // Logits in 4 × 4 (head, key) blocks: each of the 16 blocks is summed by 16 threads
        // (a channel slice each, lanes 0–15 of a half-warp), so that a pair of shared loads
        // feeds 16 FMAs; the slices are added by shuffles.
        {
            int slice = threadIdx.x & 15, grp = threadIdx.x >> 4;
            int hb = (grp >> 2) * 4, kb = (grp & 3) * 4;
            float d[4][4];
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 4; ++b) d[a][b] = 0.0f;
            if (hb < hg && kb < kt) {
                for (int c = slice; c < hd; c += 16) {
                    float qv[4], kv4[4];
#pragma unroll
                    for (int a = 0; a < 4; ++a) qv[a] = qs[(hb + a) * stride + c];
#pragma unroll
                    for (int b = 0; b < 4; ++b) kv4[b] = ks[(kb + b) * stride + c];
#pragma unroll
                    for (int a = 0; a < 4; ++a)
#pragma unroll
                        for (int b = 0; b < 4; ++b) d[a][b] += qv[a] * kv4[b];
                }
            }
#pragma unroll
            for (int a = 0; a < 4; ++a)
#pragma unroll
                for (int b = 0; b < 4; ++b)
#pragma unroll
                    for (int o = 8; o > 0; o >>= 1)
                        d[a][b] += __shfl_xor_sync(0xffffffffu, d[a][b], o);
            if (slice == 0) {
#pragma unroll
                for (int a = 0; a < 4; ++a)
#pragma unroll
                    for (int b = 0; b < 4; ++b)
                        if (hb + a < hg && kb + b < kt)
                            ps[(hb + a) * ATT_KT + kb + b] = d[a][b] * scale;
            }
        }
        __syncthreads();
        if (threadIdx.x < hg) {
            int h = threadIdx.x;
            float m_old = m_s[h], m_new = m_old;
            for (int j = 0; j < kt; ++j) m_new = fmaxf(m_new, ps[h * ATT_KT + j]);
            float sum = 0.0f;
            for (int j = 0; j < kt; ++j) {
                float e = expf(ps[h * ATT_KT + j] - m_new);
                ps[h * ATT_KT + j] = e;
                sum += e;
            }
            float f = m_old == NEG_INF ? 0.0f : expf(m_old - m_new);
            l_run = l_run * f + sum;
            m_s[h] = m_new;
            rescale[h] = f;
        }
        __syncthreads();
#pragma unroll
        for (int h = 0; h < ATT_HG; ++h) {
            if (h >= hg) break;
            float f = rescale[h];
#pragma unroll
            for (int j = 0; j < ATT_CPT; ++j) acc[h][j] *= f;
        }
        // Each value loaded once for all the block's heads.
        for (int i = 0; i < kt; ++i) {
            float v[ATT_CPT];
#pragma unroll
            for (int j = 0; j < ATT_CPT; ++j) {
                int c = threadIdx.x + j * blockDim.x;
                v[j] = c < hd ? ks[i * stride + c] : 0.0f;
            }
#pragma unroll
            for (int h = 0; h < ATT_HG; ++h) {
                if (h >= hg) break;
                float p = ps[h * ATT_KT + i];
#pragma unroll
                for (int j = 0; j < ATT_CPT; ++j) acc[h][j] += p * v[j];
            }
        }
    }
    __syncthreads();
    if (threadIdx.x < hg) rescale[threadIdx.x] = l_run;
    __syncthreads();
    // Split: the unnormalized sums, max and total, merged by dsv4_attention_merge_kernel.
    long long n_parts = (long long)gridDim.x * heads * splits;
    float* part_ml = part + n_parts * hd;
#pragma unroll
    for (int h = 0; h < ATT_HG; ++h) {
        if (h >= hg || h0 + h >= heads) break;
        long long at = ((long long)r * heads + h0 + h) * splits + z;
        if (splits > 1 && threadIdx.x == 0) {
            part_ml[2 * at] = m_s[h];
            part_ml[2 * at + 1] = rescale[h];
        }
#pragma unroll
        for (int j = 0; j < ATT_CPT; ++j) {
            int c = threadIdx.x + j * blockDim.x;
            if (c >= hd) break;
            if (splits > 1) {
                part[at * hd + c] = acc[h][j];
            } else {
                out[((long long)r * heads + h0 + h) * hd + c] = acc[h][j] / rescale[h];
            }
        }
    }
}

// The splits of dsv4_attention_kernel merged, in split order: one block a (row, head). Each
// split's factor is computed once (shared memory), and the channel loop's loads unrolled.
// A split whose factor is 0 (no keys, or all of them far below the row's max) adds
// exactly nothing and is not read: splits without keys leave their sums unwritten.
// At most ATT_MAX_MERGE splits: the host takes at most ATT_MAX_SPLITS (32).
#define ATT_MAX_MERGE 64
extern "C" __global__ void dsv4_attention_merge_kernel(float* out, const float* part, int splits,
                                                       int hd) {
    __shared__ float factor[ATT_MAX_MERGE];
    __shared__ float inv_l;
    long long rh = blockIdx.x, n_parts = (long long)gridDim.x * splits;
    const float* ml = part + n_parts * hd + rh * splits * 2;
    if (threadIdx.x < 32) {
        float m = NEG_INF;
        for (int z = threadIdx.x; z < splits; z += 32) m = fmaxf(m, ml[2 * z]);
        m = ds_warp_max(m);
        for (int z = threadIdx.x; z < splits; z += 32)
            factor[z] = ml[2 * z] != NEG_INF ? expf(ml[2 * z] - m) : 0.0f;
        __syncwarp();
        if (threadIdx.x == 0) {
            float l = 0.0f;
            for (int z = 0; z < splits; ++z) l += ml[2 * z + 1] * factor[z];
            inv_l = 1.0f / l;
        }
    }
    __syncthreads();
    const float* pr = part + rh * splits * hd;
    for (int c = threadIdx.x; c < hd; c += blockDim.x) {
        float o = 0.0f;
#pragma unroll 8
        for (int z = 0; z < splits; ++z)
            if (factor[z] != 0.0f) o += pr[(long long)z * hd + c] * factor[z];
        out[rh * hd + c] = o * inv_l;
    }
}
