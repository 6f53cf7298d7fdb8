// torch.topk's CPU selection, tie for tie, for DeepSeek-V4's indexer and router, and the
// indexer's top-k kernel (prepended to `deepseek_v4.cu`'s program, whose router uses
// `tk_select`). `src/kernels/cpu/torch_topk.rs` says why ties must resolve this way
// and is the host twin of these steps.

// libstdc++'s heap select (64·k <= n, then its heap sort) or introselect over (value,
// index) pairs, on one thread. The kept pairs end up in v[0..k), x[0..k).
__device__ __forceinline__ bool tk_before(float a, float b) {
    return (isnan(a) && !isnan(b)) || a > b;
}
__device__ __forceinline__ void tk_swap(float* v, int* x, int a, int b) {
    float tv = v[a]; v[a] = v[b]; v[b] = tv;
    int tx = x[a]; x[a] = x[b]; x[b] = tx;
}
__device__ void tk_adjust_heap(float* v, int* x, int len, int hole, float val, int vi) {
    int top = hole, child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (tk_before(v[child], v[child - 1])) child--;
        v[hole] = v[child]; x[hole] = x[child];
        hole = child;
    }
    if ((len & 1) == 0 && len >= 2 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        v[hole] = v[child - 1]; x[hole] = x[child - 1];
        hole = child - 1;
    }
    while (hole > top) {
        int parent = (hole - 1) / 2;
        if (!tk_before(v[parent], val)) break;
        v[hole] = v[parent]; x[hole] = x[parent];
        hole = parent;
    }
    v[hole] = val; x[hole] = vi;
}
__device__ void tk_heap_select(float* v, int* x, int n, int middle) {
    if (middle >= 2) {
        for (int parent = (middle - 2) / 2;; --parent) {
            tk_adjust_heap(v, x, middle, parent, v[parent], x[parent]);
            if (parent == 0) break;
        }
    }
    for (int i = middle; i < n; ++i) {
        if (tk_before(v[i], v[0])) {
            float val = v[i]; int vi = x[i];
            v[i] = v[0]; x[i] = x[0];
            tk_adjust_heap(v, x, middle, 0, val, vi);
        }
    }
}
__device__ void tk_insertion_sort(float* v, int* x, int n) {
    for (int i = 1; i < n; ++i) {
        float val = v[i]; int vi = x[i];
        int j = i;
        if (tk_before(val, v[0])) {
            for (; j > 0; --j) { v[j] = v[j - 1]; x[j] = x[j - 1]; }
        } else {
            while (tk_before(val, v[j - 1])) { v[j] = v[j - 1]; x[j] = x[j - 1]; --j; }
        }
        v[j] = val; x[j] = vi;
    }
}
__device__ void tk_select(float* v, int* x, int n, int k) {
    if (k * 64 <= n) {
        tk_heap_select(v, x, n, k);
        for (int last = k - 1; last > 0; --last) {  // __sort_heap
            float val = v[last]; int vi = x[last];
            v[last] = v[0]; x[last] = x[0];
            tk_adjust_heap(v, x, last, 0, val, vi);
        }
        return;
    }
    int nth = k - 1, first = 0, last = n;
    if (nth == n) return;
    int depth = 2 * (31 - __clz(n));
    while (last - first > 3) {
        if (depth == 0) {
            tk_heap_select(v + first, x + first, last - first, nth + 1 - first);
            tk_swap(v, x, first, nth);
            return;
        }
        --depth;
        // __unguarded_partition_pivot on [first, last)
        int a = first + 1, b = first + (last - first) / 2, c = last - 1, m;
        if (tk_before(v[a], v[b])) m = tk_before(v[b], v[c]) ? b : (tk_before(v[a], v[c]) ? c : a);
        else m = tk_before(v[a], v[c]) ? a : (tk_before(v[b], v[c]) ? c : b);
        tk_swap(v, x, first, m);
        int lo = first + 1, hi = last;
        for (;;) {
            while (tk_before(v[lo], v[first])) ++lo;
            --hi;
            while (tk_before(v[first], v[hi])) --hi;
            if (lo >= hi) break;
            tk_swap(v, x, lo, hi);
            ++lo;
        }
        if (lo <= nth) first = lo; else last = lo;
    }
    tk_insertion_sort(v + first, x + first, last - first);
}

// The indexer's k entries of each row, as torch.topk over the row's visible scores keeps
// them, in ascending entry order (the CPU backend's `index_select`); −1 past the row's
// visible count. One block a row. Each entry's rank (ties to the lower index) gives the
// kept set unless the k-th value recurs past the k-th place; only then does thread 0 run
// torch's selection, over `scratch` (2·max_visible ints a row), with `scores` as its values.
extern "C" __global__ void dsv4_topk_kernel(int* sel, float* scores, int* scratch,
                                            const unsigned int* rows, int rate,
                                            int max_visible, int k) {
    __shared__ float kth;
    __shared__ int straddle;
    __shared__ int warp_counts[32];
    int r = blockIdx.x;
    int visible = ((int)rows[2 * r + 1] + 1) / rate;
    float* s = scores + (long long)r * max_visible;
    int* idx = scratch + 2LL * r * max_visible;
    int* keep = idx + max_visible;
    int* out = sel + (long long)r * k;
    for (int i = threadIdx.x; i < k; i += blockDim.x) out[i] = i < visible && visible <= k ? i : -1;
    if (visible <= k) return;
    if (threadIdx.x == 0) straddle = 0;
    for (int i = threadIdx.x; i < visible; i += blockDim.x) {
        float v = s[i];
        int rank = 0;
        for (int j = 0; j < visible && rank < k; ++j) {
            float o = s[j];
            rank += tk_before(o, v) || (o == v && j < i);
        }
        idx[i] = rank;
        if (rank == k - 1) kth = v;
    }
    __syncthreads();
    for (int i = threadIdx.x; i < visible; i += blockDim.x) {
        if (idx[i] >= k && s[i] == kth) straddle = 1;
        keep[i] = idx[i] < k;
    }
    __syncthreads();
    if (straddle) {
        if (threadIdx.x == 0) {
            for (int i = 0; i < visible; ++i) idx[i] = i;
            tk_select(s, idx, visible, k);
            for (int i = 0; i < visible; ++i) keep[i] = 0;
            for (int j = 0; j < k; ++j) keep[idx[j]] = 1;
        }
        __syncthreads();
    }
    // Compaction in entry order, a block-wide chunk at a time.
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    int base_out = 0;
    for (int base = 0; base < visible; base += blockDim.x) {
        int i = base + threadIdx.x;
        int f = i < visible ? keep[i] : 0;
        unsigned ballot = __ballot_sync(0xffffffffu, f);
        if (lane == 0) warp_counts[warp] = __popc(ballot);
        __syncthreads();
        int before = base_out;
        for (int w = 0; w < warp; ++w) before += warp_counts[w];
        if (f) out[before + __popc(ballot & ((1u << lane) - 1u))] = i;
        int total = 0;
        for (int w = 0; w < warps; ++w) total += warp_counts[w];
        __syncthreads();
        base_out += total;
    }
}
