//! Fused backend operations as compositions of the plain ones: what a backend without the
//! fused kernel runs (the CPU always, a device for shapes its kernel does not take), one
//! implementation for both.

use super::{Backend, QkvHeads};

/// `Backend::qkv_into_cache` one operation at a time. `k` and `v` receive the projection's
/// columns; `normed` is scratch for the per-head norms (at least as long as q's rows).
#[allow(clippy::too_many_arguments)]
pub fn qkv_by_parts<B: Backend>(
    b: &B,
    qkv: &B::Buf,
    heads: QkvHeads,
    qk_norm: Option<(&B::Buf, &B::Buf, f32)>,
    positions: &[u32],
    cos_sin: &B::Buf,
    cache: &mut B::KvCache,
    layer: usize,
    slots: &[u32],
    q_out: &mut B::Buf,
    [k, v, normed]: [&mut B::Buf; 3],
) {
    let QkvHeads {
        num_heads,
        num_kv_heads,
        head_dim,
    } = heads;
    let (qd, kvd, tokens) = (
        num_heads * head_dim,
        num_kv_heads * head_dim,
        positions.len(),
    );
    let width = qd + 2 * kvd;
    b.copy_columns(qkv, width, 0, qd, tokens, q_out);
    b.copy_columns(qkv, width, qd, kvd, tokens, k);
    b.copy_columns(qkv, width, qd + kvd, kvd, tokens, v);
    if let Some((qn, kn, eps)) = qk_norm {
        // Qwen3 normalizes each head.
        b.rms_norm(q_out, qn, eps, tokens * num_heads, head_dim, normed);
        b.copy_columns(normed, qd, 0, qd, tokens, q_out);
        b.rms_norm(k, kn, eps, tokens * num_kv_heads, head_dim, normed);
        b.copy_columns(normed, kvd, 0, kvd, tokens, k);
    }
    b.rope(q_out, positions, num_heads, head_dim, cos_sin);
    b.rope(k, positions, num_kv_heads, head_dim, cos_sin);
    b.kv_write(cache, layer, k, v, slots);
}
