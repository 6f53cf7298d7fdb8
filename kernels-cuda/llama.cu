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
// The row a decode-attention block (x index) works on: in a step that mixes prefill chunks
// and decode rows, only the decode rows get blocks (`split_rows` lists them), so thousands
// of flash rows do not each launch a block that only returns; otherwise every row.
#define SPLIT_ROW(split_rows) ((split_rows) != 0 ? (int)(split_rows)[blockIdx.x] : (int)blockIdx.x)

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

// Or e4m3 codes (`--kv-cache-dtype fp8`), with an f32 scale per (slot, kv head) that they
// are multiplied by: the head's largest magnitude maps to 448, as the CPU backend does.
typedef unsigned char u8;
__device__ __forceinline__ float kv_e4m3(u32 b) {
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)b));
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)(h2 & 0xffffu)));
    return f;
}
// Two codes (the low byte first) at once.
__device__ __forceinline__ float2 kv_e4m3x2(u32 pair) {
    u32 h2;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"((unsigned short)pair));
    float lo, hi;
    asm("cvt.f32.f16 %0, %1;" : "=f"(lo) : "h"((unsigned short)(h2 & 0xffffu)));
    asm("cvt.f32.f16 %0, %1;" : "=f"(hi) : "h"((unsigned short)(h2 >> 16)));
    return make_float2(lo, hi);
}
__device__ __forceinline__ float kv_load(const u8* p, long long i) { return kv_e4m3(p[i]); }
__device__ __forceinline__ u8 kv_to_e4m3(float v) {
    unsigned short r;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %1;" : "=h"(r) : "f"(v));
    return (u8)(r & 0xffu);
}

// Programmatic dependent launch (Hopper). In a recorded decode step the edges between
// troupe's kernels are programmatic (graph.rs), so a kernel's blocks may be scheduled while
// its predecessor drains: every kernel first waits here until the predecessor has finished
// and its writes are visible, then lets its own successor be scheduled the same way. That
// hides the launch latency between the ~10 dependent launches a layer. Elsewhere (eager
// launches, older GPUs) both instructions are no-ops.
__device__ __forceinline__ void pdl_enter() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// A warp's head of `per_lane` elements a lane (`e`, element lane + 32i) into the cache at
// `base`: as is, or in e4m3 scaled by the head's largest magnitude / 448, its scale at
// scales[scale_at].
template <typename T>
__device__ __forceinline__ void kv_store_head(T* cache, float*, long long, long long base,
                                              const float* e, int per_lane, int lane) {
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (i < per_lane) kv_store(cache, base + lane + 32 * i, e[i]);
}
__device__ __forceinline__ void kv_store_head(u8* cache, float* scales, long long scale_at,
                                              long long base, const float* e, int per_lane,
                                              int lane) {
    float amax = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (i < per_lane) amax = fmaxf(amax, fabsf(e[i]));
    amax = warp_max(amax);
    float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    if (lane == 0) scales[scale_at] = scale;
#pragma unroll
    for (int i = 0; i < 8; ++i)
        if (i < per_lane) cache[base + lane + 32 * i] = kv_to_e4m3(e[i] / scale);
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

// Eight values a thread: two 16-byte loads and one 16-byte store where both addresses
// allow it (a GEMM's operand may start mid-buffer), one at a time otherwise. A value a
// thread left the copy at a third of the copy bandwidth.
#define TO_BF16_PER_THREAD 8
extern "C" __global__ void f32_to_bf16_kernel(bf16_t* out, const float* in, long long n) {
    pdl_enter();
    long long i = ((long long)blockIdx.x * blockDim.x + threadIdx.x) * TO_BF16_PER_THREAD;
    if (i >= n) return;
    bool aligned = (((unsigned long long)in | (unsigned long long)out) & 15) == 0;
    if (aligned && i + TO_BF16_PER_THREAD <= n) {
        float4 a = *(const float4*)(in + i), b = *(const float4*)(in + i + 4);
        uint4 o;
        o.x = (u32)f32_to_bf16(a.x) | ((u32)f32_to_bf16(a.y) << 16);
        o.y = (u32)f32_to_bf16(a.z) | ((u32)f32_to_bf16(a.w) << 16);
        o.z = (u32)f32_to_bf16(b.x) | ((u32)f32_to_bf16(b.y) << 16);
        o.w = (u32)f32_to_bf16(b.z) | ((u32)f32_to_bf16(b.w) << 16);
        *(uint4*)(out + i) = o;
        return;
    }
    long long end = i + TO_BF16_PER_THREAD < n ? i + TO_BF16_PER_THREAD : n;
    for (; i < end; i++) out[i] = f32_to_bf16(in[i]);
}

// out[t, :] = table[id, :] with id = ids[t], or — where `picked` is given and
// picked[t] != NOT_PICKED — the previous step's greedy pick picks[picked[t]], still on the
// device (zero-overhead scheduling without a host round trip).
#define NOT_PICKED 0xffffffffu
extern "C" __global__ void __launch_bounds__(1024)
    embedding_kernel(float* out, const bf16_t* table, const u32* ids, const u32* picked,
                     const u32* picks, int dim) {
    pdl_enter();
    int t = blockIdx.x;
    u32 id = ids[t];
    if (picked != 0 && picked[t] != NOT_PICKED) id = picks[picked[t]];
    const bf16_t* row = table + (long long)id * dim;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) out[(long long)t * dim + d] = bf16_to_f32(row[d]);
}

// y[rows, cols] += bias: blockIdx.y strides the rows, x spans a row's columns, four at a
// time where the width allows (every model's does). An element a thread with a 64-bit
// modulo made this pass 0.65 TB/s on an H100: a fifth of the vision tower's time.
extern "C" __global__ void add_bias_kernel(float* y, const float* bias, int rows, int cols) {
    pdl_enter();
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    for (long long row = blockIdx.y; row < rows; row += gridDim.y) {
        float* yr = y + row * cols;
        if ((cols & 3) == 0) {
            if (4 * c < cols) {
                float4 v = reinterpret_cast<float4*>(yr)[c];
                float4 b = reinterpret_cast<const float4*>(bias)[c];
                v.x += b.x; v.y += b.y; v.z += b.z; v.w += b.w;
                reinterpret_cast<float4*>(yr)[c] = v;
            }
        } else if (c < cols) {
            yr[c] += bias[c];
        }
    }
}

// One block per row. A batch-1 row is latency-bound, not bandwidth-bound: the host picks
// blockDim = dim / 4 (up to 1024 threads), and each thread issues all its 16-byte loads
// (at most RMS_VECS) before the first use, holding its part of the row in registers
// between the sum and the write. Rows whose width is not a multiple of 4 or is wider than
// 4 · RMS_VECS · blockDim take the strided loop. `residual`, when given, gets x added first
// (residual += x) and the norm is of the sum.
// `out_bf16`, when given, gets a bf16 copy of the output (the next GEMM's operand, so that
// cuBLAS's input needs no conversion launch of its own).
#define RMS_VECS 4
__device__ void rms_norm_row(float* residual, const float* x, const float* w, float eps, int dim,
                             float* out, bf16_t* out_bf16) {
    __shared__ float scratch[32];
    long long base = (long long)blockIdx.x * dim;
    int n4 = dim >> 2;
    if ((dim & 3) == 0 && n4 <= RMS_VECS * (int)blockDim.x) {
        const float4* xr = (const float4*)(x + base);
        float4* rr = residual != 0 ? (float4*)(residual + base) : 0;
        const float4* wr = (const float4*)w;
        // The weights load with x: after the sum, a load between stores to `out` (which
        // may alias them, for all the compiler knows) waits a round trip each.
        float4 v[RMS_VECS], g[RMS_VECS];
#pragma unroll
        for (int i = 0; i < RMS_VECS; ++i) {
            int c = threadIdx.x + i * blockDim.x;
            if (c < n4) v[i] = xr[c], g[i] = wr[c];
        }
        float ss = 0.0f;
#pragma unroll
        for (int i = 0; i < RMS_VECS; ++i) {
            int c = threadIdx.x + i * blockDim.x;
            if (c >= n4) continue;
            if (rr != 0) {
                float4 r = rr[c];
                v[i] = make_float4(r.x + v[i].x, r.y + v[i].y, r.z + v[i].z, r.w + v[i].w);
                rr[c] = v[i];
            }
            ss += v[i].x * v[i].x + v[i].y * v[i].y + v[i].z * v[i].z + v[i].w * v[i].w;
        }
        float inv = rsqrtf(block_sum(ss, scratch) / dim + eps);
        float4* o = (float4*)(out + base);
#pragma unroll
        for (int i = 0; i < RMS_VECS; ++i) {
            int c = threadIdx.x + i * blockDim.x;
            if (c >= n4) continue;
            float4 r = make_float4(v[i].x * inv * g[i].x, v[i].y * inv * g[i].y, v[i].z * inv * g[i].z,
                                   v[i].w * inv * g[i].w);
            o[c] = r;
            if (out_bf16 != 0) {
                uint2 packed;
                packed.x = (u32)f32_to_bf16(r.x) | ((u32)f32_to_bf16(r.y) << 16);
                packed.y = (u32)f32_to_bf16(r.z) | ((u32)f32_to_bf16(r.w) << 16);
                ((uint2*)(out_bf16 + base))[c] = packed;
            }
        }
        return;
    }
    const float* xr = residual != 0 ? residual + base : x + base;
    float ss = 0.0f;
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float v = xr[d];
        if (residual != 0) {
            v += x[base + d];
            residual[base + d] = v;
        }
        ss += v * v;
    }
    float inv = rsqrtf(block_sum(ss, scratch) / dim + eps);
    for (int d = threadIdx.x; d < dim; d += blockDim.x) {
        float r = xr[d] * inv * w[d];
        out[base + d] = r;
        if (out_bf16 != 0) out_bf16[base + d] = f32_to_bf16(r);
    }
}

// out = x / rms(x) * w.
extern "C" __global__ void __launch_bounds__(1024)
    rms_norm_kernel(float* out, const float* x, const float* w, float eps, int dim,
                    bf16_t* out_bf16) {
    pdl_enter();
    rms_norm_row(0, x, w, eps, dim, out, out_bf16);
}

// residual += x; out = rms_norm(residual) * w.
extern "C" __global__ void __launch_bounds__(1024)
    add_rms_norm_kernel(float* residual, const float* x, const float* w, float eps, int dim,
                        float* out, bf16_t* out_bf16) {
    pdl_enter();
    rms_norm_row(residual, x, w, eps, dim, out, out_bf16);
}

extern "C" __global__ void add_kernel(float* residual, const float* x, long long n) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) residual[i] += x[i];
}

// Rotate-half RoPE. cos_sin[pos, :half] = cos, [pos, half:] = sin. One block per row.
extern "C" __global__ void rope_kernel(float* x, const u32* positions, int num_heads,
                                       int head_dim, const float* cos_sin) {
    pdl_enter();
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
// `out_bf16`, when given, gets a bf16 copy (the down projection's cuBLAS operand).
extern "C" __global__ void silu_mul_kernel(float* out, const float* gate_up, int rows, int width,
                                           bf16_t* out_bf16) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * width) return;
    long long r = i / width, c = i % width;
    float g = gate_up[r * 2 * width + c], u = gate_up[r * 2 * width + width + c];
    float a = g / (1.0f + expf(-g)) * u;
    out[i] = a;
    if (out_bf16 != 0) out_bf16[i] = f32_to_bf16(a);
}

extern "C" __global__ void copy_columns_kernel(float* dst, const float* src, int src_width,
                                               int col_start, int width, int rows) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)rows * width) return;
    long long r = i / width, c = i % width;
    dst[i] = src[r * src_width + col_start + c];
}

extern "C" __global__ void gather_rows_kernel(float* out, const float* x, const u32* rows,
                                              int width, int num_rows) {
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (long long)num_rows * width) return;
    long long r = i / width, c = i % width;
    out[i] = x[(long long)rows[r] * width + c];
}

// Words per row of apply_verified's metadata (graph.rs's VERIFIED_META); the last is
// written here: the drafts the row was moved back by, for sample_kernel's seeded draws.
#define VERIFIED_META 7

// Rows continuing a verify row of the step before (greedy, or seeded and drawn here), planned as if it kept every
// draft: one block per row counts the drafts the verify row's picks agree with, then moves
// the row's tokens back by those it rejected (positions, KV slots, visible keys) and points
// its first token at the pick drawn after the kept ones. Runs on a recorded step's
// metadata after it is copied to the device and before the graph replays.
extern "C" __global__ void apply_verified_kernel(u32* positions, u32* slots, u32* row_visible,
                                                 u32* picked, const u32* tables,
                                                 u32* meta, const u32* picks,
                                                 int num_rows, int block_size) {
    int r = blockIdx.x;
    if (r >= num_rows) return;
    u32* m = meta + r * VERIFIED_META;
    u32 start = m[0], n = m[1], first = m[2], num_drafts = m[3], table = m[4];
    const u32* drafts = meta + m[5];
    u32 kept = 0;
    while (kept < num_drafts && picks[first + kept] == drafts[kept]) kept++;
    u32 rejected = num_drafts - kept;
    for (u32 t = threadIdx.x; t < n; t += blockDim.x) {
        u32 pos = positions[start + t] - rejected;
        positions[start + t] = pos;
        slots[start + t] = tables[table + pos / block_size] * block_size + pos % block_size;
        row_visible[start + t] -= rejected;
    }
    if (threadIdx.x == 0) {
        picked[start] = first + kept;
        m[6] = rejected;
    }
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
    pdl_enter();
    kv_write(k_cache, v_cache, k, v, slots, kv_dim, num_tokens);
}

extern "C" __global__ void kv_write_bf16_kernel(bf16_t* k_cache, bf16_t* v_cache, const float* k,
                                                const float* v, const u32* slots, int kv_dim,
                                                int num_tokens) {
    pdl_enter();
    kv_write(k_cache, v_cache, k, v, slots, kv_dim, num_tokens);
}

// An fp8 cache's K and V rows: a block per token, a warp per head (its scale needs the
// head's largest magnitude).
extern "C" __global__ void kv_write_fp8_kernel(u8* k_cache, u8* v_cache, float* k_scales,
                                               float* v_scales, const float* k, const float* v,
                                               const u32* slots, int num_kv_heads, int head_dim) {
    pdl_enter();
    int t = blockIdx.x;
    u32 slot = slots[t];
    if (slot == PAD_SLOT) return;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    long long kv_dim = (long long)num_kv_heads * head_dim;
    for (int hh = warp; hh < 2 * num_kv_heads; hh += num_warps) {
        bool is_v = hh >= num_kv_heads;
        int h = is_v ? hh - num_kv_heads : hh;
        const float* src = (is_v ? v : k) + t * kv_dim + (long long)h * head_dim;
        float amax = 0.0f;
        for (int d = lane; d < head_dim; d += 32) amax = fmaxf(amax, fabsf(src[d]));
        amax = warp_max(amax);
        float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
        u8* dst = (is_v ? v_cache : k_cache) + slot * kv_dim + (long long)h * head_dim;
        for (int d = lane; d < head_dim; d += 32) dst[d] = kv_to_e4m3(src[d] / scale);
        if (lane == 0) (is_v ? v_scales : k_scales)[(long long)slot * num_kv_heads + h] = scale;
    }
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
    pdl_enter();
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
    pdl_enter();
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    unsigned long long h = splitmix64(seed ^ splitmix64((unsigned long long)i));
    float u = (float)(h >> 40) / 16777216.0f;
    out[i] = f32_to_bf16(mean + (2.0f * u - 1.0f) * half_width);
}

// The stacked q/k/v projection of one token into attention's inputs, in one launch: q and
// k normalised per head when norms are given (Qwen3), rotated (rotate-half RoPE), q written
// to q_out and k and v written straight into the cache slot (a padding row's skipped). A
// warp per head; head_dim a multiple of 64 up to 256, so a lane's element d and its RoPE
// partner d ± head_dim/2 lie in the same lane. The arithmetic is rms_norm_kernel's and
// rope_kernel's. Blocks (token, y): each of a token's gridDim.y blocks takes its share of heads.
template <typename T>
__device__ void qkv_rope_cache(float* q_out, T* k_cache, T* v_cache, float* k_scales,
                               float* v_scales, const float* qkv, const float* q_norm,
                               const float* k_norm, float eps, const u32* positions,
                               const float* cos_sin, const u32* slots, int num_heads,
                               int num_kv_heads, int head_dim) {
    int t = blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = blockDim.x >> 5;
    int per_lane = head_dim / 32, half = head_dim / 2;
    int width = (num_heads + 2 * num_kv_heads) * head_dim;
    u32 slot = slots[t];
    const float* row = qkv + (long long)t * width;
    const float* table = cos_sin + (long long)positions[t] * head_dim;
    int stride = gridDim.y * num_warps;  // the token's heads are spread over gridDim.y blocks
    for (int h = blockIdx.y * num_warps + warp; h < num_heads + 2 * num_kv_heads; h += stride) {
        bool is_q = h < num_heads, is_v = h >= num_heads + num_kv_heads;
        if (!is_q && slot == PAD_SLOT) continue;
        float e[8];
#pragma unroll
        for (int i = 0; i < 8; ++i)
            if (i < per_lane) e[i] = row[h * head_dim + lane + 32 * i];
        const float* norm = is_q ? q_norm : k_norm;
        if (!is_v && norm != 0) {
            float ss = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (i < per_lane) ss += e[i] * e[i];
            float inv = rsqrtf(warp_sum(ss) / head_dim + eps);
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (i < per_lane) e[i] = e[i] * inv * norm[lane + 32 * i];
        }
        if (!is_v) {
            float r[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                if (i >= per_lane) continue;
                int d = lane + 32 * i;
                int k = d < half ? d : d - half;
                float c = table[k], s = table[half + k];
                // The partner of element i is element i ± per_lane/2 of the same lane.
                int j = d < half ? i + per_lane / 2 : i - per_lane / 2;
                float partner = 0.0f;
#pragma unroll
                for (int x = 0; x < 8; ++x)
                    if (x == j) partner = e[x];
                r[i] = d < half ? e[i] * c - partner * s : e[i] * c + partner * s;
            }
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (i < per_lane) e[i] = r[i];
        }
        if (is_q) {
            float* o = q_out + ((long long)t * num_heads + h) * head_dim;
#pragma unroll
            for (int i = 0; i < 8; ++i)
                if (i < per_lane) o[lane + 32 * i] = e[i];
        } else {
            int kvh = is_v ? h - num_heads - num_kv_heads : h - num_heads;
            T* cache = is_v ? v_cache : k_cache;
            long long base = (long long)slot * num_kv_heads * head_dim + kvh * head_dim;
            kv_store_head(cache, is_v ? v_scales : k_scales,
                          (long long)slot * num_kv_heads + kvh, base, e, per_lane, lane);
        }
    }
}

#define QKV_ENTRY(NAME, T)                                                                    \
    extern "C" __global__ void __launch_bounds__(512)                                         \
        NAME(float* q_out, T* k_cache, T* v_cache, const float* qkv, const float* q_norm,     \
             const float* k_norm, float eps, const u32* positions, const float* cos_sin,      \
             const u32* slots, int num_heads, int num_kv_heads, int head_dim) {               \
        pdl_enter();                                                                          \
        qkv_rope_cache(q_out, k_cache, v_cache, (float*)0, (float*)0, qkv, q_norm, k_norm,    \
                       eps, positions, cos_sin, slots, num_heads, num_kv_heads, head_dim);     \
    }
QKV_ENTRY(qkv_rope_cache_f32_kernel, float)
QKV_ENTRY(qkv_rope_cache_bf16_kernel, bf16_t)
extern "C" __global__ void __launch_bounds__(512)
    qkv_rope_cache_fp8_kernel(float* q_out, u8* k_cache, u8* v_cache, float* k_scales,
                              float* v_scales, const float* qkv, const float* q_norm,
                              const float* k_norm, float eps, const u32* positions,
                              const float* cos_sin, const u32* slots, int num_heads,
                              int num_kv_heads, int head_dim) {
    pdl_enter();
    qkv_rope_cache(q_out, k_cache, v_cache, k_scales, v_scales, qkv, q_norm, k_norm, eps,
                   positions, cos_sin, slots, num_heads, num_kv_heads, head_dim);
}
