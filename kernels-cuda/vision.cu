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

// x = 0.5 x (1 + erf(x / sqrt 2)), as nn.GELU() computes it.
extern "C" __global__ void gelu_kernel(float* x, long long n) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = 0.5f * x[i] * (1.f + erff(x[i] * 0.70710678118654752f));
}
