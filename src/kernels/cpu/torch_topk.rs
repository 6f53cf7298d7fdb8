//! `torch.topk` on the CPU, tie for tie. transformers' DeepSeek-V4 picks the indexer's
//! entries and the router's experts with `topk`, and where scores tie at the k-th place
//! (an indexer score of exactly 0 is common: ReLU zeroes every head whose dot product is
//! negative) the entries kept are whichever ATen's selection leaves in front. ATen runs
//! libstdc++'s `std::partial_sort` when `64·k <= n`, else `std::nth_element` followed by
//! `std::sort` of the first `k − 1`, over `(value, index)` pairs compared by value alone
//! (NaN largest). Those algorithms are deterministic, so the same steps here keep the same
//! entries: introselect with median-of-three pivots and a `2·⌊log2 n⌋` depth limit, heap
//! select, insertion sort below 17 elements, as libstdc++ writes them.
//!
//! The kept set depends on `n`, the length of the row: transformers' cached decode scores
//! the entries emitted so far, which is what is passed here (see `deepseek_v4::index_select`).

type Elem = (f32, usize);

/// `x` before `y` in the ordering: the comparator ATen passes for `largest=True`.
fn before(x: &Elem, y: &Elem) -> bool {
    (x.0.is_nan() && !y.0.is_nan()) || x.0 > y.0
}

/// The indices `torch.topk(values, k, sorted=sorted)` returns on the CPU, in its order.
pub fn torch_top_k(values: &[f32], k: usize, sorted: bool) -> Vec<usize> {
    let n = values.len();
    let k = k.min(n);
    if k == 0 {
        return Vec::new();
    }
    let mut q: Vec<Elem> = values.iter().copied().zip(0..).collect();
    if k * 64 <= n {
        partial_sort(&mut q, k);
    } else {
        nth_element(&mut q, k - 1);
        if sorted {
            sort(&mut q[..k - 1]);
        }
    }
    q[..k].iter().map(|e| e.1).collect()
}

fn lg(n: usize) -> usize {
    (usize::BITS - 1 - n.leading_zeros()) as usize
}

fn partial_sort(q: &mut [Elem], middle: usize) {
    heap_select(q, middle);
    sort_heap(&mut q[..middle]);
}

fn nth_element(q: &mut [Elem], nth: usize) {
    if nth == q.len() {
        return;
    }
    let (mut first, mut last) = (0, q.len());
    let mut depth = 2 * lg(q.len());
    while last - first > 3 {
        if depth == 0 {
            heap_select(&mut q[first..last], nth + 1 - first);
            q.swap(first, nth);
            return;
        }
        depth -= 1;
        let cut = first + partition_pivot(&mut q[first..last]);
        if cut <= nth {
            first = cut;
        } else {
            last = cut;
        }
    }
    insertion_sort(&mut q[first..last]);
}

/// `std::sort`: introsort down to runs of 16, then one insertion sort over everything.
fn sort(q: &mut [Elem]) {
    if q.len() > 1 {
        introsort_loop(q, 0, q.len(), 2 * lg(q.len()));
        final_insertion_sort(q);
    }
}

const THRESHOLD: usize = 16;

fn introsort_loop(q: &mut [Elem], first: usize, mut last: usize, mut depth: usize) {
    while last - first > THRESHOLD {
        if depth == 0 {
            partial_sort(&mut q[first..last], last - first);
            return;
        }
        depth -= 1;
        let cut = first + partition_pivot(&mut q[first..last]);
        introsort_loop(q, cut, last, depth);
        last = cut;
    }
}

fn final_insertion_sort(q: &mut [Elem]) {
    if q.len() > THRESHOLD {
        insertion_sort(&mut q[..THRESHOLD]);
        for i in THRESHOLD..q.len() {
            unguarded_linear_insert(q, i);
        }
    } else {
        insertion_sort(q);
    }
}

fn insertion_sort(q: &mut [Elem]) {
    for i in 1..q.len() {
        if before(&q[i], &q[0]) {
            let v = q[i];
            q.copy_within(0..i, 1);
            q[0] = v;
        } else {
            unguarded_linear_insert(q, i);
        }
    }
}

fn unguarded_linear_insert(q: &mut [Elem], mut last: usize) {
    let v = q[last];
    while before(&v, &q[last - 1]) {
        q[last] = q[last - 1];
        last -= 1;
    }
    q[last] = v;
}

/// Moves the median of `q[1]`, `q[mid]`, `q[len − 1]` to `q[0]` and partitions `q[1..]`
/// around it; returns the cut.
fn partition_pivot(q: &mut [Elem]) -> usize {
    let (a, b, c) = (1, q.len() / 2, q.len() - 1);
    let median = if before(&q[a], &q[b]) {
        if before(&q[b], &q[c]) {
            b
        } else if before(&q[a], &q[c]) {
            c
        } else {
            a
        }
    } else if before(&q[a], &q[c]) {
        a
    } else if before(&q[b], &q[c]) {
        c
    } else {
        b
    };
    q.swap(0, median);
    let (mut first, mut last) = (1, q.len());
    loop {
        while before(&q[first], &q[0]) {
            first += 1;
        }
        last -= 1;
        while before(&q[0], &q[last]) {
            last -= 1;
        }
        if first >= last {
            return first;
        }
        q.swap(first, last);
        first += 1;
    }
}

fn heap_select(q: &mut [Elem], middle: usize) {
    make_heap(&mut q[..middle]);
    for i in middle..q.len() {
        if before(&q[i], &q[0]) {
            // `__pop_heap(first, middle, i)`: the top goes to `i`, `q[i]` sifts in.
            let v = q[i];
            q[i] = q[0];
            adjust_heap(&mut q[..middle], 0, v);
        }
    }
}

fn make_heap(h: &mut [Elem]) {
    let len = h.len();
    if len < 2 {
        return;
    }
    let mut parent = (len - 2) / 2;
    loop {
        let v = h[parent];
        adjust_heap(h, parent, v);
        if parent == 0 {
            return;
        }
        parent -= 1;
    }
}

fn sort_heap(h: &mut [Elem]) {
    let mut last = h.len();
    while last > 1 {
        last -= 1;
        let v = h[last];
        h[last] = h[0];
        adjust_heap(&mut h[..last], 0, v);
    }
}

/// libstdc++'s `__adjust_heap`: the hole at `hole` walks down to a leaf along the larger
/// children, then `value` is pushed back up from there.
fn adjust_heap(h: &mut [Elem], mut hole: usize, value: Elem) {
    let len = h.len();
    let top = hole;
    let mut child = hole;
    while child < len.saturating_sub(1) / 2 {
        child = 2 * (child + 1);
        if before(&h[child], &h[child - 1]) {
            child -= 1;
        }
        h[hole] = h[child];
        hole = child;
    }
    if len & 1 == 0 && len >= 2 && child == (len - 2) / 2 {
        child = 2 * (child + 1);
        h[hole] = h[child - 1];
        hole = child - 1;
    }
    // `__push_heap`
    while hole > top {
        let parent = (hole - 1) / 2;
        if !before(&h[parent], &value) {
            break;
        }
        h[hole] = h[parent];
        hole = parent;
    }
    h[hole] = value;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_values_come_out_largest_first() {
        let v = [0.5, -1.0, 3.0, 2.0, 7.0, 0.0];
        assert_eq!(torch_top_k(&v, 3, true), vec![4, 2, 3]);
        assert_eq!(torch_top_k(&v, 9, true).len(), 6);
    }
}
