//! Packed (GGML) weights against 8-bit activations, as tasks of `ROWS_PER_TASK` weight
//! rows: one product (`gemv_packed`, `matmul`'s packed path) or several at once
//! (`matmul_many`: an MoE layer's experts in one parallel sweep). Each output is one
//! weight row's dot with one activation row, so a product's bits do not depend on how its
//! rows are grouped or scheduled.

use rayon::prelude::*;

use super::packed::{Q8Act, RowDot, row_dot};
use super::qmatrix::{CpuMatrix, PackedPart};
use super::simd::{CpuPath, cpu_path};

/// Weight rows per parallel task: enough to amortize scheduling, few enough to balance.
pub(super) const ROWS_PER_TASK: usize = 32;

#[derive(Clone, Copy)]
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: tasks write disjoint columns of `out`; the pointer outlives the parallel scope.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Through a method, so closures capture the `Send` wrapper, not its raw field.
    pub(super) fn get(self) -> *mut f32 {
        self.0
    }
}

/// Packed weights against 8-bit activations: tasks of `ROWS_PER_TASK` weight rows of
/// one part each, every group of four activation rows swept over a task's rows (which
/// stay in L1) by one kernel call.
pub(super) fn gemv_packed(
    x: &[f32],
    m: usize,
    parts: &[PackedPart],
    n: usize,
    k: usize,
    out: &mut [f32],
) {
    let mut act = Q8Act::default();
    act.quantize(x, m, k);
    let mut tasks = Vec::new();
    packed_tasks(parts, 0, &mut tasks);
    let product = PackedProduct {
        act: &act,
        m,
        n,
        out: OutPtr(out.as_mut_ptr()),
    };
    tasks.par_iter().for_each(|t| t.run(&product));
}

/// A product of several packed matrices with their own activations (`MatJob`s: the experts
/// of one MoE layer, say), as one parallel sweep: every job's weight rows are tasks of the
/// same pool, so no job waits on another's tail and no thread idles between them. The same
/// bits as `matmul` on each job alone (outside the batch-invariant mode, which has its own
/// path). Every job's weights are packed.
pub fn matmul_many(jobs: &mut [MatJob<'_>]) {
    let mut products = Vec::with_capacity(jobs.len());
    let mut acts: Vec<Q8Act> = jobs.iter().map(|_| Q8Act::default()).collect();
    let mut tasks = Vec::new();
    for (p, (j, act)) in jobs.iter_mut().zip(&mut acts).enumerate() {
        let (n, k) = (j.w.rows(), j.w.cols());
        assert!(
            j.x.len() >= j.m * k && j.out.len() >= j.m * n,
            "matmul shape mismatch"
        );
        act.quantize(j.x, j.m, k);
        let CpuMatrix::Packed { parts, .. } = j.w else {
            panic!("matmul_many takes packed weights only")
        };
        packed_tasks(parts, p, &mut tasks);
        products.push((j.m, n, OutPtr(j.out.as_mut_ptr())));
    }
    let products: Vec<PackedProduct<'_>> = products
        .into_iter()
        .zip(&acts)
        .map(|((m, n, out), act)| PackedProduct { act, m, n, out })
        .collect();
    tasks.par_iter().for_each(|t| t.run(&products[t.product]));
}

/// One product of `matmul_many`: `out[m, n] = x · wᵀ`.
pub struct MatJob<'a> {
    pub x: &'a [f32],
    pub m: usize,
    pub w: &'a CpuMatrix,
    pub out: &'a mut [f32],
}

/// A packed product's activations and output, which its tasks share.
struct PackedProduct<'a> {
    act: &'a Q8Act,
    m: usize,
    n: usize,
    out: OutPtr,
}

/// `ROWS_PER_TASK` weight rows of one part of product `product`'s weights.
struct PackedTask<'a> {
    part: &'a PackedPart,
    dots: (RowDot<8>, RowDot<4>, RowDot<1>),
    rows: std::ops::Range<usize>,
    product: usize,
}

fn packed_tasks<'a>(parts: &'a [PackedPart], product: usize, tasks: &mut Vec<PackedTask<'a>>) {
    for part in parts {
        let (Some(dot8), Some(dot4), Some(dot1)) = (
            row_dot::<8>(part.ggml_type),
            row_dot::<4>(part.ggml_type),
            row_dot::<1>(part.ggml_type),
        ) else {
            unreachable!("a Packed part is only made of a type with a row dot")
        };
        for start in (0..part.rows).step_by(ROWS_PER_TASK) {
            tasks.push(PackedTask {
                part,
                dots: (dot8, dot4, dot1),
                rows: start..(start + ROWS_PER_TASK).min(part.rows),
                product,
            });
        }
    }
}

impl PackedTask<'_> {
    /// The task's rows against every activation row of `p`.
    fn run(&self, p: &PackedProduct<'_>) {
        let (part, rows, (dot8, dot4, dot1)) = (self.part, &self.rows, self.dots);
        let (m, n, act) = (p.m, p.n, p.act);
        let row_bytes = part.bytes.len() / part.rows;
        let w = &part.bytes[rows.start * row_bytes..rows.end * row_bytes];
        let first = part.first_row + rows.start;
        let out = p.out;
        let write = |i: usize, j: usize, v: f32| {
            debug_assert!(i < m && first + j < n);
            // SAFETY: (i, first + j) is written by this task only, i < m, first + j < n.
            unsafe { *out.get().add(i * n + first + j) = v };
        };
        // Eight activation rows a weight expansion where 32 vector registers hold their
        // sums (AVX-512); with 16 (AVX2) they would spill. A row's sums are its own either
        // way: the same bits alone or in a group.
        let eights = cpu_path() >= CpuPath::Avx512;
        let mut eight = [[0f32; 8]; ROWS_PER_TASK];
        let mut four = [[0f32; 4]; ROWS_PER_TASK];
        let mut one = [[0f32; 1]; ROWS_PER_TASK];
        let mut i = 0;
        while eights && i + 8 <= m {
            dot8(
                w,
                std::array::from_fn(|r| act.row(i + r)),
                &mut eight[..rows.len()],
            );
            for (j, v) in eight[..rows.len()].iter().enumerate() {
                for (r, &v) in v.iter().enumerate() {
                    write(i + r, j, v);
                }
            }
            i += 8;
        }
        while i + 4 <= m {
            dot4(
                w,
                [i, i + 1, i + 2, i + 3].map(|r| act.row(r)),
                &mut four[..rows.len()],
            );
            for (j, v) in four[..rows.len()].iter().enumerate() {
                for (r, &v) in v.iter().enumerate() {
                    write(i + r, j, v);
                }
            }
            i += 4;
        }
        for r in i..m {
            dot1(w, [act.row(r)], &mut one[..rows.len()]);
            for (j, v) in one[..rows.len()].iter().enumerate() {
                write(r, j, v[0]);
            }
        }
    }
}
