// Sampling where the logits lie (appended to llama.cu's source): per listed row, the CPU
// sampler's pipeline for rows without processors — temperature → top-k → top-p → min-p →
// the draw uniform(seed, position, STREAM_SAMPLE) over the kept candidates walked in the
// CPU's order (value descending under total_cmp, ties by ascending id) — and the token's
// log-probability under the distribution it was drawn from. Greedy rows (temperature 0)
// take the greedy pick. One block of 1024 threads per row.
//
// Every cut keeps a prefix of that order, and every decision is "where does the running
// mass of the prefix cross a target": the block finds that place without sorting, by a
// radix walk over the 32-bit order keys (4 bits a pass, per-thread bins, no atomics), then
// the id within the tied values. Sums are f64 like the CPU's, but in another order, so a
// draw landing within rounding of a boundary may differ from the CPU's; nothing else does.
//
// meta[SAMPLE_META·i ..] = (logit row, pick index, top_k, temperature bits, top_p bits,
// min_p bits, seed lo, seed hi, position lo, position hi, scratch row, moved back, draft,
// mask).
// `keys` and `weights` are scratch, one vocabulary-sized row each per sampled (not greedy)
// row. "Moved back" is NO_MOVE or the row's index among apply_verified's rows in
// `verified`: a row continuing a verify row was planned as if it kept every draft, and only
// the device knows how many it rejected, so its draws' positions move back by that count
// here. "Draft" is NO_DRAFT or the token a verify row proposed at this position, accepted
// by rejection sampling as spec::verify::rejection does with a certain (n-gram) drafter:
// kept with probability p(draft) (the STREAM_ACCEPT draw), else the pick is drawn from p
// without it — never the draft, so the host and apply_verified count acceptance by picks.
// "Mask" is NO_MASK or the word offset in `masks` of the row's grammar mask, a bit per id
// (bit id % 32 of word id / 32): ids without their bit count as logits of −∞, as the host
// sampler's masked rows.
#define SAMPLE_META 14
#define NO_MASK 0xffffffffu
#define NO_MOVE 0xffffffffu
#define NO_DRAFT 0xffffffffu
#define STREAM_ACCEPT 2ull
#define SAMPLE_BINS 16

// Ascending in f32::total_cmp order.
__device__ __forceinline__ u32 order_key(float v) {
    u32 b = __float_as_uint(v);
    return b ^ ((u32)((int)b >> 31) | 0x80000000u);
}

__device__ __forceinline__ float key_value(u32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k ^ 0x80000000u) : ~k);
}

// exp(value − max) as the CPU's fill_weights computes it: in f64, rounded to f32, and 0
// below −104 (where the f32 result is 0 anyway).
__device__ __forceinline__ float candidate_weight(float value, float max_value) {
    float d = value - max_value;
    return d < -104.0f ? 0.0f : (float)exp((double)d);
}

__device__ double block_sum_f64(double v, double* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    int num_warps = (blockDim.x + 31) >> 5;
    double t = lane < num_warps ? scratch[lane] : 0.0;
    for (int o = 16; o > 0; o >>= 1) t += __shfl_xor_sync(0xffffffffu, t, o);
    return t;
}

// The kept candidates: keys above `key`, those equal to it up to id `id`, weights ≥ `wmin`.
// Each of the three is a prefix of the sampling order, so their meet is one too.
// `excluded` (or −1) is left out besides: a rejected draft, for the draw from the rest.
struct Cut {
    u32 key;
    int id;
    float wmin;
    int excluded;
};

__device__ __forceinline__ bool kept(const Cut& c, int i, u32 k, float w) {
    return (k > c.key || (k == c.key && i <= c.id)) && w >= c.wmin && i != c.excluded;
}

__device__ double kept_mass(const u32* keys, const float* w, int V, Cut c, double* scratch) {
    double s = 0.0;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        if (kept(c, i, keys[i], w[i])) s += w[i];
    return block_sum_f64(s, scratch);
}

// The id of the n-th (1-based, ascending ids) kept candidate whose key is `key`. Each
// thread scans a contiguous id range so that an exclusive scan of their counts orders them.
__device__ int nth_kept_id(const u32* keys, const float* w, int V, Cut c, u32 key, int n) {
    __shared__ int s_warp[32];
    __shared__ int s_id;
    int per = (V + blockDim.x - 1) / blockDim.x;
    int lo = threadIdx.x * per, hi = min(V, lo + per);
    int count = 0;
    for (int i = lo; i < hi; ++i) count += keys[i] == key && kept(c, i, key, w[i]);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int incl = count;
    for (int o = 1; o < 32; o <<= 1) {
        int t = __shfl_up_sync(0xffffffffu, incl, o);
        if (lane >= o) incl += t;
    }
    if (threadIdx.x == 0) s_id = -1;
    if (lane == 31) s_warp[warp] = incl;
    __syncthreads();
    int before = 0;
    for (int i = 0; i < warp; ++i) before += s_warp[i];
    int excl = before + incl - count;
    if (excl < n && excl + count >= n) {
        int need = n - excl;
        for (int i = lo; i < hi; ++i) {
            if (keys[i] == key && kept(c, i, key, w[i]) && --need == 0) {
                s_id = i;
                break;
            }
        }
    }
    __syncthreads();
    int id = s_id;
    __syncthreads();
    return id;
}

struct Selected {
    u32 key;
    int id;
    double before;  // mass of the kept candidates ahead of it
};

// The kept candidate, in sampling order, at which the running mass (1 per candidate, or its
// weight) first exceeds `target` — or reaches it, with `reach` — and the last one with mass
// when none does.
__device__ Selected select_ordered(const u32* keys, const float* w, int V, Cut c,
                                   bool by_weight, double target, bool reach, double* scratch) {
    __shared__ double s_bins[32][SAMPLE_BINS];
    __shared__ u32 s_prefix;
    __shared__ double s_before, s_group_mass;
    u32 prefix = 0, mask = 0;
    double before = 0.0, group_mass = 0.0;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    for (int shift = 28; shift >= 0; shift -= 4) {
        float bins[SAMPLE_BINS];
#pragma unroll
        for (int b = 0; b < SAMPLE_BINS; ++b) bins[b] = 0.0f;
        for (int i = threadIdx.x; i < V; i += blockDim.x) {
            u32 k = keys[i];
            float wi = w[i];
            if ((k & mask) != prefix || !kept(c, i, k, wi)) continue;
            u32 d = (k >> shift) & (SAMPLE_BINS - 1);
            float m = by_weight ? wi : 1.0f;
#pragma unroll
            for (int b = 0; b < SAMPLE_BINS; ++b) bins[b] += d == (u32)b ? m : 0.0f;
        }
#pragma unroll
        for (int b = 0; b < SAMPLE_BINS; ++b) {
            double v = bins[b];
            for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0) s_bins[warp][b] = v;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int num_warps = blockDim.x >> 5;
            int chosen = -1, last = -1;
            double mass = 0.0;
            for (int b = SAMPLE_BINS - 1; b >= 0; --b) {
                double m = 0.0;
                for (int x = 0; x < num_warps; ++x) m += s_bins[x][b];
                if (m == 0.0) continue;
                double cum = before + m;
                if (reach ? cum >= target : cum > target) {
                    chosen = b;
                    mass = m;
                    break;
                }
                before = cum;
                last = b;
                mass = m;
            }
            if (chosen < 0) {  // rounding kept the target out of reach: the last with mass
                chosen = last < 0 ? 0 : last;
                before -= mass;
            }
            s_prefix = prefix | ((u32)chosen << shift);
            s_before = before;
            s_group_mass = mass;
        }
        __syncthreads();
        prefix = s_prefix;
        before = s_before;
        group_mass = s_group_mass;
        mask |= (u32)(SAMPLE_BINS - 1) << shift;
        __syncthreads();
    }
    // Equal keys are equal values and equal weights: the tie group's members share a mass.
    double count = 0.0;
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        count += keys[i] == prefix && kept(c, i, prefix, w[i]);
    count = block_sum_f64(count, scratch);
    double each = by_weight ? group_mass / count : 1.0;
    double n;
    if (each <= 0.0) {
        n = count;
    } else if (reach) {
        n = ceil((target - before) / each);
    } else {
        n = floor((target - before) / each) + 1.0;
    }
    n = fmin(fmax(n, 1.0), count);
    Selected out;
    out.key = prefix;
    out.id = nth_kept_id(keys, w, V, c, prefix, (int)n);
    out.before = before + (n - 1.0) * each;
    return out;
}

// Folds value v at index i into a running (max, first index of it, Σ exp(x − max)).
__device__ __forceinline__ void greedy_fold(float v, int i, float& best, int& best_i,
                                            float& sum) {
    if (v > best) {
        sum = sum * expf(best - v) + 1.0f;  // expf(−∞) = 0 on the first value
        best = v;
        best_i = i;
    } else {
        sum += expf(v - best);
    }
}

// greedy_fold over four consecutive values: their maximum rescales the running sum once,
// and the four exponentials are taken against the updated maximum. A single block folds
// the whole row at batch 1 and is bound by issue (~24 instructions a value one at a time,
// ~11 this way).
__device__ __forceinline__ void greedy_fold4(float4 v, int i, float& best, int& best_i,
                                             float& sum) {
    float m4 = fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w));
    if (m4 > best) {
        sum = sum * expf(best - m4);  // expf(−∞) = 0 on the first values
        best = m4;
        best_i = v.x == m4 ? i : v.y == m4 ? i + 1 : v.z == m4 ? i + 2 : i + 3;
    }
    sum += (expf(v.x - best) + expf(v.y - best)) + (expf(v.z - best) + expf(v.w - best));
}

// Merges another thread's running triple into this one's.
__device__ __forceinline__ void greedy_merge(float ob, int oi, float os, float& best,
                                             int& best_i, float& sum) {
    float m = fmaxf(best, ob);
    if (m == NEG_INF) return;
    sum = (best == NEG_INF ? 0.0f : sum * expf(best - m)) + (ob == NEG_INF ? 0.0f : os * expf(ob - m));
    if (ob > best || (ob == best && oi < best_i)) best_i = oi;
    best = m;
}

// The greedy pick of x: the first index of the maximum, and its log-probability, in one
// pass over the row (a running maximum rescales the running sum of exponentials).
__device__ __forceinline__ bool masked_out(const u32* mask, int i) {
    return mask != nullptr && ((mask[i >> 5] >> (i & 31)) & 1u) == 0;
}

__device__ void greedy_row(const float* x, const u32* mask, int vocab, u32* out_id,
                           float* out_logprob) {
    __shared__ float s_best[32], s_sum[32];
    __shared__ int s_idx[32];
    float best = NEG_INF, sum = 0.0f;
    int best_i = 0x7fffffff;
    if (mask != nullptr) {
        // Masked ids are left out of the fold (−∞ contributes nothing).
        for (int i = threadIdx.x; i < vocab; i += blockDim.x)
            if (!masked_out(mask, i)) greedy_fold(x[i], i, best, best_i, sum);
    } else if ((vocab & 3) == 0 && ((unsigned long long)x & 15) == 0) {
        const float4* x4 = (const float4*)x;
        for (int i = threadIdx.x; i < vocab / 4; i += blockDim.x) {
            greedy_fold4(x4[i], 4 * i, best, best_i, sum);
        }
    } else {
        for (int i = threadIdx.x; i < vocab; i += blockDim.x) greedy_fold(x[i], i, best, best_i, sum);
    }
    for (int o = 16; o > 0; o >>= 1) {
        float ob = __shfl_xor_sync(0xffffffffu, best, o);
        int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
        float os = __shfl_xor_sync(0xffffffffu, sum, o);
        greedy_merge(ob, oi, os, best, best_i, sum);
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, num_warps = (blockDim.x + 31) >> 5;
    if (lane == 0) {
        s_best[warp] = best;
        s_idx[warp] = best_i;
        s_sum[warp] = sum;
    }
    __syncthreads();
    if (warp == 0) {
        best = lane < num_warps ? s_best[lane] : NEG_INF;
        best_i = lane < num_warps ? s_idx[lane] : 0x7fffffff;
        sum = lane < num_warps ? s_sum[lane] : 0.0f;
        for (int o = 16; o > 0; o >>= 1) {
            float ob = __shfl_xor_sync(0xffffffffu, best, o);
            int oi = __shfl_xor_sync(0xffffffffu, best_i, o);
            float os = __shfl_xor_sync(0xffffffffu, sum, o);
            greedy_merge(ob, oi, os, best, best_i, sum);
        }
        if (lane == 0) {
            // No finite value (every id masked, or NaN): an id the next step can embed.
            *out_id = best_i < vocab ? (u32)best_i : 0u;
            *out_logprob = -logf(sum);  // x[pick] − (max + log Σ exp(x − max)), x[pick] = max
        }
    }
}

__device__ __forceinline__ double uniform_draw(unsigned long long seed, unsigned long long pos,
                                               unsigned long long stream) {
    unsigned long long h = splitmix64(seed ^ splitmix64(pos ^ splitmix64(stream)));
    return (double)(h >> 11) / 9007199254740992.0;  // 2^53
}

extern "C" __global__ void __launch_bounds__(1024)
    sample_kernel(u32* out_ids, float* out_logprobs, const float* logits, const u32* meta,
                  u32* keys_all, float* weights_all, const u32* verified, const u32* masks,
                  int V) {
    pdl_enter();
    __shared__ double scratch[32];
    __shared__ u32 s_max[32];
    const u32* p = meta + SAMPLE_META * blockIdx.x;
    const float* x = logits + (long long)p[0] * V;
    u32 slot = p[1];
    int top_k = (int)p[2];
    float temperature = __uint_as_float(p[3]);
    float top_p = __uint_as_float(p[4]), min_p = __uint_as_float(p[5]);
    unsigned long long seed = ((unsigned long long)p[7] << 32) | p[6];
    unsigned long long pos = ((unsigned long long)p[9] << 32) | p[8];
    if (p[11] != NO_MOVE) pos -= verified[p[11] * VERIFIED_META + 6];
    const u32* mask = p[13] == NO_MASK ? nullptr : masks + p[13];
    if (temperature == 0.0f) {
        greedy_row(x, mask, V, out_ids + slot, out_logprobs + slot);
        return;
    }
    u32* keys = keys_all + (long long)p[10] * V;
    float* w = weights_all + (long long)p[10] * V;
    u32 best = 0;
    for (int i = threadIdx.x; i < V; i += blockDim.x) {
        u32 k = order_key(masked_out(mask, i) ? NEG_INF : x[i] / temperature);  // the CPU's f32 division
        keys[i] = k;
        best = max(best, k);
    }
    for (int o = 16; o > 0; o >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, o));
    if ((threadIdx.x & 31) == 0) s_max[threadIdx.x >> 5] = best;
    __syncthreads();
    if (threadIdx.x < 32) {
        u32 b = threadIdx.x < (blockDim.x >> 5) ? s_max[threadIdx.x] : 0u;
        for (int o = 16; o > 0; o >>= 1) b = max(b, __shfl_xor_sync(0xffffffffu, b, o));
        if (threadIdx.x == 0) s_max[0] = b;
    }
    __syncthreads();
    float max_scaled = key_value(s_max[0]);
    for (int i = threadIdx.x; i < V; i += blockDim.x)
        w[i] = candidate_weight(key_value(keys[i]), max_scaled);
    __syncthreads();
    Cut cut = {0u, 0x7fffffff, 0.0f, -1};
    if (top_k > 0 && top_k < V) {
        Selected s = select_ordered(keys, w, V, cut, false, (double)(top_k - 1), false, scratch);
        cut.key = s.key;
        cut.id = s.id;
    }
    double total = kept_mass(keys, w, V, cut, scratch);
    if (top_p < 1.0f) {
        Selected s = select_ordered(keys, w, V, cut, true, (double)top_p * total, true, scratch);
        cut.key = s.key;
        cut.id = s.id;
        total = kept_mass(keys, w, V, cut, scratch);
    }
    if (min_p > 0.0f) {
        // Weights are relative to the most likely candidate (weight 1): a prefix again.
        cut.wmin = min_p;
        total = kept_mass(keys, w, V, cut, scratch);
    }
    u32 draft = p[12];
    double w_draft = 0.0;
    if (draft != NO_DRAFT && draft < (u32)V && kept(cut, (int)draft, keys[draft], w[draft]))
        w_draft = w[draft];
    if (w_draft > 0.0 && uniform_draw(seed, pos, STREAM_ACCEPT) < w_draft / total) {
        if (threadIdx.x == 0) {
            out_ids[slot] = draft;
            out_logprobs[slot] =
                (float)((double)(key_value(keys[draft]) - max_scaled) - log(total));
        }
        return;
    }
    // Rejected (or no draft): the draw from p without the draft, which the walk leaves out
    // — so rounding can never land on it.
    if (w_draft > 0.0) cut.excluded = (int)draft;
    double target = uniform_draw(seed, pos, 0ull) * (total - w_draft);
    Selected s = select_ordered(keys, w, V, cut, true, target, false, scratch);
    if (threadIdx.x == 0) {
        // Nothing left to draw (the draft held all the mass but rounding rejected it, or
        // a row of NaN): an id the next step can embed all the same.
        out_ids[slot] = s.id >= 0 ? (u32)s.id : (w_draft > 0.0 ? draft : 0u);
        out_logprobs[slot] = (float)((double)(key_value(s.key) - max_scaled) - log(total));
    }
}
