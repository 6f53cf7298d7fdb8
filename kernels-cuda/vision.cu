// An image encoder's kernels (Qwen2.5-VL's vision tower): attention without a mask inside
// segments of rows (its windows, or the whole image), and the erf GELU of its merger.
// Part of llama.cu's program (its `u32`, `pdl_enter`).

#define SEG_WARPS 4
#define SEG_WARP_ROWS 4
#define SEG_BLOCK_ROWS (SEG_WARPS * SEG_WARP_ROWS)
#define SEG_KEYS 32

// Row `row` of q, k, v ([rows, heads * head_dim], f32, head_dim <= 128) attends to rows
// seg[2 row] .. seg[2 row + 1]. A block takes SEG_BLOCK_ROWS consecutive rows of one head
// (blockIdx.y) and walks the keys their segments span in tiles of SEG_KEYS, each tile's K
// and V brought into shared memory once for all its rows; a warp takes SEG_WARP_ROWS rows:
// lane j scores key j of the tile (K rows padded to an odd stride: no bank conflicts),
// the softmax runs online across tiles, and each lane accumulates dims lane, lane + 32, ...
// Keys outside a row's segment (blocks straddling two windows) score nothing.
// Dynamic shared memory: (SEG_KEYS (head_dim + 1) + SEG_KEYS head_dim + SEG_BLOCK_ROWS
// head_dim) floats.
extern "C" __global__ void segment_attention_kernel(float* out, const float* q, const float* k,
                                                    const float* v, const u32* seg, int rows,
                                                    int heads, int head_dim, float scale) {
    pdl_enter();
    extern __shared__ float seg_smem[];
    int kstride = head_dim + 1;
    float* ks = seg_smem;
    float* vs = ks + SEG_KEYS * kstride;
    float* qs = vs + SEG_KEYS * head_dim;
    int head = blockIdx.y, first = blockIdx.x * SEG_BLOCK_ROWS;
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    long long width = (long long)heads * head_dim;
    for (int i = threadIdx.x; i < SEG_BLOCK_ROWS * head_dim; i += blockDim.x) {
        int row = first + i / head_dim;
        qs[i] = row < rows ? q[row * width + head * head_dim + i % head_dim] * scale : 0.f;
    }
    int last = min(first + SEG_BLOCK_ROWS, rows) - 1;
    u32 key_lo = seg[2 * first], key_hi = seg[2 * last + 1];
    float m[SEG_WARP_ROWS], l[SEG_WARP_ROWS], acc[SEG_WARP_ROWS][4];
    u32 lo[SEG_WARP_ROWS], hi[SEG_WARP_ROWS];
#pragma unroll
    for (int r = 0; r < SEG_WARP_ROWS; r++) {
        int row = first + warp * SEG_WARP_ROWS + r;
        m[r] = NEG_INF;
        l[r] = 0.f;
        lo[r] = row < rows ? seg[2 * row] : 0;
        hi[r] = row < rows ? seg[2 * row + 1] : 0;
#pragma unroll
        for (int j = 0; j < 4; j++) acc[r][j] = 0.f;
    }
    for (u32 t0 = key_lo; t0 < key_hi; t0 += SEG_KEYS) {
        __syncthreads();  // the tile before is read (and the queries written)
        for (int i = threadIdx.x; i < SEG_KEYS * head_dim; i += blockDim.x) {
            int j = i / head_dim, d = i % head_dim;
            u32 t = t0 + j;
            bool in = t < key_hi;
            ks[j * kstride + d] = in ? k[t * width + head * head_dim + d] : 0.f;
            vs[j * head_dim + d] = in ? v[t * width + head * head_dim + d] : 0.f;
        }
        __syncthreads();
        u32 t = t0 + lane;
#pragma unroll
        for (int r = 0; r < SEG_WARP_ROWS; r++) {
            if (lo[r] >= hi[r]) continue;  // a row past the end (the warp's alike)
            const float* qr = qs + (warp * SEG_WARP_ROWS + r) * head_dim;
            const float* kr = ks + lane * kstride;
            float s = 0.f;
            for (int d = 0; d < head_dim; d++) s += qr[d] * kr[d];
            bool valid = t >= lo[r] && t < hi[r];
            s = valid ? s : NEG_INF;
            float tmax = s;
#pragma unroll
            for (int o = 16; o; o >>= 1) tmax = fmaxf(tmax, __shfl_xor_sync(0xffffffffu, tmax, o));
            float mnew = fmaxf(m[r], tmax);
            if (mnew == NEG_INF) continue;  // none of the row's keys yet (the warp's alike)
            float p = valid ? expf(s - mnew) : 0.f;
            float corr = expf(m[r] - mnew);
            float psum = p;
#pragma unroll
            for (int o = 16; o; o >>= 1) psum += __shfl_xor_sync(0xffffffffu, psum, o);
            l[r] = l[r] * corr + psum;
#pragma unroll
            for (int jj = 0; jj < 4; jj++) acc[r][jj] *= corr;
            for (int j = 0; j < SEG_KEYS; j++) {
                float pj = __shfl_sync(0xffffffffu, p, j);
                const float* vr = vs + j * head_dim;
#pragma unroll
                for (int jj = 0; jj < 4; jj++) {
                    int d = lane + 32 * jj;
                    if (d < head_dim) acc[r][jj] += pj * vr[d];
                }
            }
            m[r] = mnew;
        }
    }
#pragma unroll
    for (int r = 0; r < SEG_WARP_ROWS; r++) {
        int row = first + warp * SEG_WARP_ROWS + r;
        if (row >= rows) continue;
        float* o = out + row * width + head * head_dim;
#pragma unroll
        for (int jj = 0; jj < 4; jj++) {
            int d = lane + 32 * jj;
            if (d < head_dim) o[d] = acc[r][jj] / l[r];
        }
    }
}

// segment_attention_kernel on tensor cores, for a head_dim HD that is a multiple of 16, after
// prefill_attention.cu (its mma_bf16 and pack_bf16, its fragment layouts): a block takes
// FA_ROWS consecutive rows of one head (blockIdx.y), each of its 4 warps 16 of them, and
// walks the keys its rows' segments span in chunks of FA_KEYS. A chunk's keys (row-major)
// and values (transposed) are staged in shared memory as bf16; S = Q·Kᵀ and O += P·V are
// mma.m16n8k16 with f32 accumulators, the softmax online per row. A key outside a row's
// segment scores nothing, and a row none of whose keys a chunk holds leaves its state as it
// was (a block can straddle windows). 128 threads.
template <int HD>
__device__ void segment_attention_mma(float* out, const float* q, const float* k,
                                      const float* v, const u32* seg, int rows, int heads,
                                      float scale) {
    constexpr int KS = HD + 8;       // K row stride in bf16 (16 bytes of padding)
    constexpr int VS = FA_KEYS + 8;  // Vᵀ row stride in bf16
    constexpr int DSTEPS = HD / 16;  // k-steps of Q·Kᵀ
    constexpr int DTILES = HD / 8;   // n-tiles of O
    constexpr int PIECES = HD / 8;   // 8-dim pieces of a row
    __shared__ __align__(16) bf16_t k_s[FA_KEYS * KS];
    __shared__ __align__(16) bf16_t vt_s[HD * VS];
    int first = blockIdx.x * FA_ROWS, h = blockIdx.y;
    long long width = (long long)heads * HD;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int g = lane >> 2, t = lane & 3;
    int r0 = first + warp * 16 + g, r1 = r0 + 8;  // this thread's two rows
    int last = min(first + FA_ROWS, rows) - 1;
    u32 key_lo = seg[2 * first], key_hi = seg[2 * last + 1];
    u32 lo0 = r0 < rows ? seg[2 * r0] : 0, hi0 = r0 < rows ? seg[2 * r0 + 1] : 0;
    u32 lo1 = r1 < rows ? seg[2 * r1] : 0, hi1 = r1 < rows ? seg[2 * r1 + 1] : 0;

    // Q as A fragments, scaled, in bf16: qa[kk] covers dims 16kk .. 16kk + 15.
    u32 qa[DSTEPS][4];
    {
        const float* q0 = q + (long long)min(r0, rows - 1) * width + h * HD;
        const float* q1 = q + (long long)min(r1, rows - 1) * width + h * HD;
#pragma unroll
        for (int kk = 0; kk < DSTEPS; ++kk) {
            int d = 16 * kk + 2 * t;
            qa[kk][0] = pack_bf16(q0[d] * scale, q0[d + 1] * scale);
            qa[kk][1] = pack_bf16(q1[d] * scale, q1[d + 1] * scale);
            qa[kk][2] = pack_bf16(q0[d + 8] * scale, q0[d + 9] * scale);
            qa[kk][3] = pack_bf16(q1[d + 8] * scale, q1[d + 9] * scale);
        }
    }
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;
    float o[DTILES][4];
#pragma unroll
    for (int i = 0; i < DTILES; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    for (u32 c0 = key_lo; c0 < key_hi; c0 += FA_KEYS) {
        __syncthreads();  // the previous chunk is consumed
        for (int e = threadIdx.x; e < FA_KEYS * PIECES; e += blockDim.x) {
            int key = e / PIECES, piece = e % PIECES;
            u32 j = c0 + key;
            uint4 w = make_uint4(0u, 0u, 0u, 0u);
            if (j < key_hi) {
                const float4* src = (const float4*)(k + (long long)j * width + h * HD + piece * 8);
                float4 a = src[0], b = src[1];
                w = make_uint4(pack_bf16(a.x, a.y), pack_bf16(a.z, a.w), pack_bf16(b.x, b.y),
                               pack_bf16(b.z, b.w));
            }
            *(uint4*)(k_s + key * KS + piece * 8) = w;
        }
        for (int e = threadIdx.x; e < (FA_KEYS / 2) * PIECES; e += blockDim.x) {
            int pair = e / PIECES, piece = e % PIECES;
            u32 j = c0 + 2 * pair;
            float va[8], vb[8];
#pragma unroll
            for (int x = 0; x < 8; ++x) va[x] = vb[x] = 0.0f;
            if (j < key_hi) {
                const float4* src = (const float4*)(v + (long long)j * width + h * HD + piece * 8);
                float4 a = src[0], b = src[1];
                va[0] = a.x, va[1] = a.y, va[2] = a.z, va[3] = a.w;
                va[4] = b.x, va[5] = b.y, va[6] = b.z, va[7] = b.w;
            }
            if (j + 1 < key_hi) {
                const float4* src =
                    (const float4*)(v + (long long)(j + 1) * width + h * HD + piece * 8);
                float4 a = src[0], b = src[1];
                vb[0] = a.x, vb[1] = a.y, vb[2] = a.z, vb[3] = a.w;
                vb[4] = b.x, vb[5] = b.y, vb[6] = b.z, vb[7] = b.w;
            }
#pragma unroll
            for (int x = 0; x < 8; ++x)
                *(u32*)(vt_s + (piece * 8 + x) * VS + 2 * pair) = pack_bf16(va[x], vb[x]);
        }
        __syncthreads();

        // S = Q·Kᵀ for this warp's 16 rows and the chunk's keys.
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
            u32 j = c0 + 8 * nt + 2 * t;
            if (j < lo0 || j >= hi0) s[nt][0] = NEG_INF;
            if (j + 1 < lo0 || j + 1 >= hi0) s[nt][1] = NEG_INF;
            if (j < lo1 || j >= hi1) s[nt][2] = NEG_INF;
            if (j + 1 < lo1 || j + 1 >= hi1) s[nt][3] = NEG_INF;
            mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
            mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        float n0 = fmaxf(m0, mx0), n1 = fmaxf(m1, mx1);
        // A row with no key yet keeps 0 for its exponents' base: no inf − inf.
        float base0 = n0 == NEG_INF ? 0.0f : n0, base1 = n1 == NEG_INF ? 0.0f : n1;
        float alpha0 = expf(m0 - base0), alpha1 = expf(m1 - base1);
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
            float p0 = expf(s[nt][0] - base0), p1 = expf(s[nt][1] - base0);
            float p2 = expf(s[nt][2] - base1), p3 = expf(s[nt][3] - base1);
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
        if (r0 < rows) {
            float* o0 = out + (long long)r0 * width + h * HD + d;
            o0[0] = o[nd][0] * inv0;
            o0[1] = o[nd][1] * inv0;
        }
        if (r1 < rows) {
            float* o1 = out + (long long)r1 * width + h * HD + d;
            o1[0] = o[nd][2] * inv1;
            o1[1] = o[nd][3] * inv1;
        }
    }
}

#define SEGMENT_MMA_ENTRY(HD)                                                                  \
    extern "C" __global__ void __launch_bounds__(128) segment_attention_mma_##HD##_kernel(     \
        float* out, const float* q, const float* k, const float* v, const u32* seg, int rows,  \
        int heads, float scale) {                                                              \
        pdl_enter();                                                                           \
        segment_attention_mma<HD>(out, q, k, v, seg, rows, heads, scale);                      \
    }
SEGMENT_MMA_ENTRY(16)
SEGMENT_MMA_ENTRY(32)
SEGMENT_MMA_ENTRY(64)
SEGMENT_MMA_ENTRY(80)
SEGMENT_MMA_ENTRY(128)

// x = 0.5 x (1 + erf(x / sqrt 2)), as nn.GELU() computes it.
extern "C" __global__ void gelu_kernel(float* x, long long n) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = 0.5f * x[i] * (1.f + erff(x[i] * 0.70710678118654752f));
}
