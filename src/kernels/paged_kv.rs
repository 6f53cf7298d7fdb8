//! Shape of the paged KV cache and the per-sequence view attention reads it through.
//!
//! The cache is a pool of fixed-size blocks per layer: `[num_blocks, block_size,
//! num_kv_heads, head_dim]` for K and again for V. A sequence owns an ordered block table;
//! token `p` of it lives in block `block_table[p / block_size]` at offset
//! `p % block_size`. Which blocks a sequence gets is the scheduler's business, not this
//! module's.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheShape {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
}

impl KvCacheShape {
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }
    /// Floats of K (or of V) for one layer.
    pub fn layer_len(&self) -> usize {
        self.num_blocks * self.block_size * self.kv_dim()
    }
    pub fn num_slots(&self) -> usize {
        self.num_blocks * self.block_size
    }
}

/// One sequence's share of a step, as attention sees it.
#[derive(Debug, Clone, Copy)]
pub struct SeqAttention<'a> {
    /// Row of this sequence's first query token in the step's activations.
    pub query_start: usize,
    pub num_query_tokens: usize,
    /// Tokens in the cache after this step's KV write, the query tokens included; the
    /// query tokens are the last `num_query_tokens` of them.
    pub num_context_tokens: usize,
    pub block_table: &'a [u32],
}

/// The cache slot of position `pos` of a sequence with `block_table`.
pub fn slot_of(block_table: &[u32], block_size: usize, pos: usize) -> u32 {
    block_table[pos / block_size] * block_size as u32 + (pos % block_size) as u32
}
