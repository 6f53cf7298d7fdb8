//! Tensor-parallel sharding: which group sizes a model allows and which slice of each
//! weight a rank holds (pure arithmetic; the collectives that join the ranks are the
//! device seam, in `kernels::collective`).
//!
//! Megatron's split for the Llama family: q/k/v and gate/up are column-parallel (a rank
//! keeps whole heads and a slice of the intermediate rows), o and down are row-parallel
//! (the matching input columns), and one all-reduce after each makes every rank's
//! residual stream whole again. Embedding, norms and the output head are replicated, so
//! every rank holds the same logits and picks the same greedy tokens.

use crate::model::config::ModelConfig;

/// One rank's place in a tensor-parallel group of `size` ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TpShard {
    pub rank: usize,
    pub size: usize,
}

impl TpShard {
    /// The whole model on one rank.
    pub const WHOLE: TpShard = TpShard { rank: 0, size: 1 };

    /// This rank's part of `0..len` when `len` splits into `size` equal parts.
    pub fn range(&self, len: usize) -> std::ops::Range<usize> {
        let part = len / self.size;
        self.rank * part..(self.rank + 1) * part
    }

    /// The rank that hands its outputs to the sampler; the others only compute.
    pub fn is_leader(&self) -> bool {
        self.rank == 0
    }
}

/// Why `cfg` cannot split into `size` ranks, or `None` when it can: whole query and KV
/// heads per rank and an equal share of the MLP's intermediate rows. (A quantized
/// row-parallel slice that cuts through blocks is dequantized, not refused.)
pub fn tp_problem(cfg: &ModelConfig, size: usize) -> Option<String> {
    if size == 0 {
        return Some("tensor parallel size must be at least 1".into());
    }
    let checks = [
        ("attention heads", cfg.num_heads),
        ("KV heads", cfg.num_kv_heads),
        ("MLP intermediate rows", cfg.intermediate_size),
    ];
    for (what, n) in checks {
        if !n.is_multiple_of(size) {
            return Some(format!(
                "tensor parallel size {size} does not divide the model's {n} {what}"
            ));
        }
    }
    None
}

/// The largest group size `cfg` allows on at most `num_devices` devices.
pub fn largest_valid_tp(cfg: &ModelConfig, num_devices: usize) -> Option<usize> {
    (1..=num_devices)
        .rev()
        .find(|&size| tp_problem(cfg, size).is_none())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::{Arch, RopeScaling};

    fn cfg(num_heads: usize, num_kv_heads: usize, intermediate_size: usize) -> ModelConfig {
        ModelConfig {
            arch: Arch::Llama,
            vocab_size: 384,
            hidden_size: 64,
            intermediate_size,
            num_layers: 2,
            num_heads,
            num_kv_heads,
            head_dim: 16,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            rope_scaling: RopeScaling::None,
            max_context_tokens: 128,
            attention_bias: false,
            tie_word_embeddings: false,
            fp8_block: crate::model::config::FP8_BLOCK,
            mrope_section: None,
        }
    }

    #[test]
    fn a_group_size_must_divide_heads_kv_heads_and_the_mlp() {
        let c = cfg(32, 8, 14336);
        assert_eq!(tp_problem(&c, 2), None);
        assert_eq!(tp_problem(&c, 8), None);
        let three = tp_problem(&c, 3).unwrap();
        assert!(three.contains("32 attention heads"), "{three}");
        let sixteen = tp_problem(&c, 16).unwrap();
        assert!(sixteen.contains("8 KV heads"), "{sixteen}");
        assert!(tp_problem(&cfg(4, 2, 130), 4).is_some());
        assert!(tp_problem(&c, 0).is_some());
    }

    #[test]
    fn the_largest_valid_size_uses_as_many_devices_as_divide() {
        let c = cfg(9, 3, 1536);
        assert_eq!(largest_valid_tp(&c, 8), Some(3));
        assert_eq!(largest_valid_tp(&c, 2), Some(1));
        assert_eq!(largest_valid_tp(&cfg(32, 8, 14336), 7), Some(4));
        assert_eq!(largest_valid_tp(&c, 0), None);
    }

    #[test]
    fn ranks_cover_a_dimension_without_overlap() {
        let parts: Vec<_> = (0..4)
            .map(|rank| TpShard { rank, size: 4 }.range(128))
            .collect();
        assert_eq!(parts, vec![0..32, 32..64, 64..96, 96..128]);
        assert_eq!(TpShard::WHOLE.range(7), 0..7);
        assert!(TpShard { rank: 0, size: 2 }.is_leader());
        assert!(!TpShard { rank: 1, size: 2 }.is_leader());
    }
}
