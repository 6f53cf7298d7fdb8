//! Shape of the paged KV cache and the per-sequence view attention reads it through.
//!
//! The cache is a pool of fixed-size blocks per layer: `[num_blocks, block_size,
//! num_kv_heads, head_dim]` for K and again for V. A sequence owns an ordered block table;
//! token `p` of it lives in block `block_table[p / block_size]` at offset
//! `p % block_size`. Which blocks a sequence gets is the scheduler's business, not this
//! module's.

/// What a K or V entry is stored in (`--kv-cache-dtype`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub enum KvDtype {
    /// The backend's own: f32 on the CPU (the numeric reference), bf16 on a GPU (f32 in
    /// its batch-invariant mode, which matches the CPU).
    #[default]
    Auto,
    Bf16,
    /// e4m3 with one f32 scale per token and kv head (its largest magnitude maps to 448):
    /// a quarter of f32's bytes, half of bf16's.
    Fp8,
    /// DeepSeek-V4 only: the seed's FP4 entries (E2M1 with an e4m3 scale per 16).
    Fp4,
}

impl KvDtype {
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::Auto => "auto",
            KvDtype::Bf16 => "bf16",
            KvDtype::Fp8 => "fp8",
            KvDtype::Fp4 => "fp4",
        }
    }

    /// Bytes one token's K (or V) of one kv head takes, `auto` taken as `auto_bytes` an
    /// entry (the backend's).
    pub fn bytes_per_head(self, head_dim: usize, auto_bytes: usize) -> usize {
        match self {
            KvDtype::Auto => head_dim * auto_bytes,
            KvDtype::Bf16 => head_dim * 2,
            KvDtype::Fp8 => head_dim + std::mem::size_of::<f32>(),
            KvDtype::Fp4 => head_dim / 2 + head_dim / 16,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(KvDtype::Auto),
            "bf16" => Ok(KvDtype::Bf16),
            "fp8" | "fp8_e4m3" => Ok(KvDtype::Fp8),
            "fp4" => Ok(KvDtype::Fp4),
            other => Err(format!(
                "unknown KV cache dtype {other:?}: expected auto, bf16, fp8 or fp4"
            )),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheShape {
    pub num_layers: usize,
    pub num_blocks: usize,
    pub block_size: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub dtype: KvDtype,
}

impl KvCacheShape {
    pub fn with_dtype(self, dtype: KvDtype) -> Self {
        KvCacheShape { dtype, ..self }
    }
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
