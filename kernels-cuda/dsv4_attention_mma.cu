// DeepSeek-V4's attention on tensor cores, for the default mode's many-row steps (prefill
// chunks, wide decode batches); appended after mma_tile.cu (`mma_bf16`, `tile_bf16x2`).
//
// Every head of a row reads the same keys (shared KV), so a row's 64 heads are the M of
// an mma: S[heads, keys] = Q · Kᵀ and O[heads, hd] += P · V with V = K. The SIMT kernel
// (`dsv4_attention_kernel`) spends ~4 shared loads and shuffles per FMA; here one
// m16n8k16 does 2 048 multiply-adds. A block takes one row and up to AM_HEADS heads, its
// 16 warps 4 head tiles × 4 (key quarters for S, channel quarters for O). Each tile of
// AM_KT keys is gathered (window ring, the chunk's rows, compressed entries: `DsAttKeys`), rounded to bf16 into shared memory beside the row's bf16 queries
// (rows padded by 16 bytes: ldmatrix without bank conflicts); the scores go through shared
// memory for an online softmax per head that starts at the head's sink, the probabilities
// back as bf16 (as flash attention rounds them). Operands in bf16 as the default mode's
// GEMMs take them; the batch-invariant mode keeps the f32 kernel. A few rows split their
// keys across blocks (grid z, whole tiles, the first split holding the sink) and leave
// dsv4_attention_merge_kernel the same partials as the f32 kernel. hd a multiple of 16, at
// most AM_MAX_HD. Dynamic shared memory: AM_SMEM_BYTES(hd). 512 threads.
#define AM_HEADS 64
#define AM_KT 64
#define AM_WARPS 16
#define AM_MAX_HD 512
#define AM_PAD 8
// Key loads in flight a thread while the output's accumulators are live (registers).
#define AM_KBATCH 8
#define AM_SS (AM_KT + 8)
#define AM_SMEM_BYTES(hd) \
    (2 * (AM_HEADS + AM_KT) * ((hd) + AM_PAD) + 4 * AM_HEADS * AM_SS + 2 * AM_HEADS * (AM_KT + AM_PAD) + 12 * AM_HEADS)

__device__ __forceinline__ u32 am_smem(const void* p) {
    u32 s;
    asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(s) : "l"(p));
    return s;
}
// Four 8×8 bf16 matrices; lane l names row l % 8 of matrix l / 8. Thread (g, t) gets row
// g, columns 2t and 2t + 1 of each (`.trans`: column g, rows 2t and 2t + 1).
__device__ __forceinline__ void am_ldmatrix(u32* r, const unsigned short* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(am_smem(p)));
}
__device__ __forceinline__ void am_ldmatrix_trans(u32* r, const unsigned short* p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(am_smem(p)));
}

// Four floats as bf16 at `dst` (8-byte aligned).
__device__ __forceinline__ void am_store4(unsigned short* dst, float4 v) {
    *(uint2*)dst = make_uint2(tile_bf16x2(v.x, v.y), tile_bf16x2(v.z, v.w));
}

// Rows of f32 (q4 float4 wide) into shared memory as bf16, B float4 loads a thread issued
// before the first is stored: a loop that stores between its loads waits out a memory
// round trip an iteration, and at batch 1 (one tile a block) those trips were most of the
// kernel's ~30 µs. A thread's (row, column) advances by the block's width without a
// division. `src(row, column)` gives the row's four floats (zero past the rows).
template <int B, class Src>
__device__ __forceinline__ void am_stage_rows(unsigned short* dst, int stride, int n_rows, int q4, Src src) {
    int total = n_rows * q4, drow = blockDim.x / q4, dcol = blockDim.x % q4;
    int row = threadIdx.x / q4, col = threadIdx.x % q4;
    for (int i0 = threadIdx.x; i0 < total; i0 += B * blockDim.x) {
        float4 v[B];
        int r0 = row, c0 = col;
#pragma unroll
        for (int u = 0; u < B; ++u) {
            v[u] = i0 + u * (int)blockDim.x < total ? src(row, 4 * col) : make_float4(0.f, 0.f, 0.f, 0.f);
            row += drow;
            col += dcol;
            if (col >= q4) col -= q4, ++row;
        }
        row = r0, col = c0;
#pragma unroll
        for (int u = 0; u < B; ++u) {
            if (i0 + u * (int)blockDim.x < total) am_store4(dst + row * stride + 4 * col, v[u]);
            row += drow;
            col += dcol;
            if (col >= q4) col -= q4, ++row;
        }
    }
}

extern "C" __global__ void __launch_bounds__(AM_WARPS * 32, 1) dsv4_attention_mma_kernel(
    float* out, const float* q, const float* kv, const float* ring, const float* entries,
    const int* sel, int sel_k, const u32* rows, const u32* seqs, const u32* block_tables,
    const float* sinks, int heads, int hd, int window, int ring_len, int rate, int block_size,
    int epb, float scale, int splits, float* part) {
    extern __shared__ __align__(16) unsigned char am_raw[];
    __shared__ const float* kptr[AM_KT];
    int stride = hd + AM_PAD;
    unsigned short* qs = (unsigned short*)am_raw;
    unsigned short* ks = qs + AM_HEADS * stride;
    float* ss = (float*)(ks + AM_KT * stride);
    unsigned short* ps = (unsigned short*)(ss + AM_HEADS * AM_SS);
    float* m_s = (float*)(ps + AM_HEADS * (AM_KT + AM_PAD));
    float* l_s = m_s + AM_HEADS;
    float* f_s = l_s + AM_HEADS;

    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, tq = lane & 3;
    int r = blockIdx.x, h0 = blockIdx.y * AM_HEADS;
    int nh = min(AM_HEADS, heads - h0);
    DsAttKeys keys = ds_att_keys(r, rows, seqs, block_tables, kv, ring, entries, sel, sel_k, hd, window, ring_len,
                                 rate, block_size, epb);
    int nk = keys.n_swa + keys.n_comp;
    int per = (nk + splits - 1) / splits;
    per = (per + AM_KT - 1) / AM_KT * AM_KT;
    int z = blockIdx.z, k_lo = z * per, k_hi = min(nk, k_lo + per);

    // The row's queries as bf16; heads past the row's are zero (their sums are not stored).
    int q4 = hd / 4;
    const float* q_row = q + ((long long)r * heads + h0) * hd;
    am_stage_rows<8>(qs, stride, AM_HEADS, q4, [&](int h, int c) {
        return h < nh ? *(const float4*)(q_row + h * hd + c) : make_float4(0.f, 0.f, 0.f, 0.f);
    });
    if (threadIdx.x < AM_HEADS) {
        int h = threadIdx.x;
        // The sink's own term, exp(0), in the first split.
        m_s[h] = z > 0 ? NEG_INF : h < nh ? sinks[h0 + h] : 0.0f;
        l_s[h] = z > 0 ? 0.0f : 1.0f;
    }

    int mt = warp >> 2, quarter = warp & 3;
    int tiles_n = hd / 8;  // O's 8-channel tiles; this warp takes quarter, quarter + 4, …
    float acc[AM_MAX_HD / 32][4];
#pragma unroll
    for (int i = 0; i < AM_MAX_HD / 32; ++i) acc[i][0] = acc[i][1] = acc[i][2] = acc[i][3] = 0.0f;

    for (int k0 = k_lo; k0 < k_hi; k0 += AM_KT) {
        int kt = min(AM_KT, k_hi - k0);
        __syncthreads();  // the previous tile's readers are done with ks, ps and kptr
        if (threadIdx.x < kt) kptr[threadIdx.x] = keys.key(k0 + threadIdx.x);
        __syncthreads();
        am_stage_rows<AM_KBATCH>(ks, stride, AM_KT, q4, [&](int j, int c) {
            return j < kt ? *(const float4*)(kptr[j] + c) : make_float4(0.f, 0.f, 0.f, 0.f);
        });
        __syncthreads();
        // S: this warp's 16 heads × 16 keys (two 8-key tiles), over hd in steps of 16.
        {
            float s[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
            int mat = lane >> 3, rr = lane & 7;
            const unsigned short* qa = qs + (16 * mt + (lane & 15)) * stride + 8 * (lane >> 4);
            const unsigned short* kb = ks + (16 * quarter + 8 * (mat >> 1) + rr) * stride + 8 * (mat & 1);
            for (int d = 0; d < hd; d += 16) {
                u32 a[4], b[4];
                am_ldmatrix(a, qa + d);
                am_ldmatrix(b, kb + d);
                mma_bf16(s[0], a[0], a[1], a[2], a[3], b[0], b[1]);
                mma_bf16(s[1], a[0], a[1], a[2], a[3], b[2], b[3]);
            }
#pragma unroll
            for (int n = 0; n < 2; ++n) {
                int key = 16 * quarter + 8 * n + 2 * tq;
                float* row_a = ss + (16 * mt + g) * AM_SS;
                float* row_b = ss + (16 * mt + g + 8) * AM_SS;
                row_a[key] = key < kt ? s[n][0] * scale : NEG_INF;
                row_a[key + 1] = key + 1 < kt ? s[n][1] * scale : NEG_INF;
                row_b[key] = key < kt ? s[n][2] * scale : NEG_INF;
                row_b[key + 1] = key + 1 < kt ? s[n][3] * scale : NEG_INF;
            }
        }
        __syncthreads();
        // Online softmax: 8 threads a head, 8 keys each, reduced by shuffles in the group.
        {
            int h = threadIdx.x >> 3, seg = threadIdx.x & 7;
            float4 v0 = *(const float4*)(ss + h * AM_SS + 8 * seg);
            float4 v1 = *(const float4*)(ss + h * AM_SS + 8 * seg + 4);
            float v[8] = {v0.x, v0.y, v0.z, v0.w, v1.x, v1.y, v1.z, v1.w}, mx = NEG_INF;
#pragma unroll
            for (int j = 0; j < 8; ++j) mx = fmaxf(mx, v[j]);
#pragma unroll
            for (int o = 4; o > 0; o >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            float m_old = m_s[h], m_new = fmaxf(m_old, mx);
            float sum = 0.0f;
            u32 pw[4];
#pragma unroll
            for (int j = 0; j < 8; j += 2) {
                float e0 = expf(v[j] - m_new), e1 = expf(v[j + 1] - m_new);
                // The sum of what the mma multiplies: the probabilities as rounded.
                pw[j / 2] = tile_bf16x2(e0, e1);
                sum += tile_bf16_lo(pw[j / 2]) + tile_bf16_hi(pw[j / 2]);
            }
            *(uint4*)(ps + h * (AM_KT + AM_PAD) + 8 * seg) = make_uint4(pw[0], pw[1], pw[2], pw[3]);
#pragma unroll
            for (int o = 4; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
            if (seg == 0) {
                float f = m_old == NEG_INF ? 0.0f : expf(m_old - m_new);
                l_s[h] = l_s[h] * f + sum;
                m_s[h] = m_new;
                f_s[h] = f;
            }
        }
        __syncthreads();
        // O: this warp's 16 heads × its channel tiles, over the tile's keys in steps of 16.
        {
            float fa = f_s[16 * mt + g], fb = f_s[16 * mt + g + 8];
#pragma unroll
            for (int i = 0; i < AM_MAX_HD / 32; ++i) {
                acc[i][0] *= fa;
                acc[i][1] *= fa;
                acc[i][2] *= fb;
                acc[i][3] *= fb;
            }
            int mat = lane >> 3, rr = lane & 7;
            const unsigned short* pa = ps + (16 * mt + (lane & 15)) * (AM_KT + AM_PAD) + 8 * (lane >> 4);
            for (int j0 = 0; j0 < kt; j0 += 16) {
                u32 a[4];
                am_ldmatrix(a, pa + j0);
                const unsigned short* vb = ks + (j0 + 8 * (mat & 1) + rr) * stride;
#pragma unroll
                for (int i = 0; i < AM_MAX_HD / 32; i += 2) {
                    int n0 = quarter + 4 * i, n1 = n0 + 4;
                    if (n0 >= tiles_n) break;
                    u32 b[4];
                    // Matrices 0, 1: keys 0–7, 8–15 of tile n0; 2, 3 of tile n1 (n1 past
                    // hd reads n0 again, its sums unused).
                    int n = (mat >> 1) && n1 < tiles_n ? n1 : n0;
                    am_ldmatrix_trans(b, vb + 8 * n);
                    mma_bf16(acc[i], a[0], a[1], a[2], a[3], b[0], b[1]);
                    mma_bf16(acc[i + 1], a[0], a[1], a[2], a[3], b[2], b[3]);
                }
            }
        }
    }
    __syncthreads();
    int ha = 16 * mt + g, hb = ha + 8;
    // One split: normalized rows; several: the unnormalized sums, max and total.
    long long n_parts = (long long)gridDim.x * heads * splits;
    float* part_ml = part + n_parts * hd;
    long long at_a = ((long long)r * heads + h0 + ha) * splits + z;
    long long at_b = ((long long)r * heads + h0 + hb) * splits + z;
    float la = splits > 1 ? 1.0f : l_s[ha], lb = splits > 1 ? 1.0f : l_s[hb];
    float* oa = splits > 1 ? part + at_a * hd : out + ((long long)r * heads + h0 + ha) * hd;
    float* ob = splits > 1 ? part + at_b * hd : out + ((long long)r * heads + h0 + hb) * hd;
    if (splits > 1 && quarter == 0 && tq == 0) {
        if (ha < nh) {
            part_ml[2 * at_a] = m_s[ha];
            part_ml[2 * at_a + 1] = l_s[ha];
        }
        if (hb < nh) {
            part_ml[2 * at_b] = m_s[hb];
            part_ml[2 * at_b + 1] = l_s[hb];
        }
    }
#pragma unroll
    for (int i = 0; i < AM_MAX_HD / 32; ++i) {
        int n = quarter + 4 * i;
        if (n >= tiles_n) break;
        int c = 8 * n + 2 * tq;
        if (ha < nh) *(float2*)(oa + c) = make_float2(acc[i][0] / la, acc[i][1] / la);
        if (hb < nh) *(float2*)(ob + c) = make_float2(acc[i][2] / lb, acc[i][3] / lb);
    }
}
