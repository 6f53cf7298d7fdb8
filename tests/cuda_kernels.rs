//! The CUDA kernels compile with NVRTC for Hopper (no GPU needed: NVRTC is a compiler).
//! CI installs NVRTC from pip, so a kernel that does not build fails here, not on a GPU.
#![cfg(feature = "cuda")]

mod common;

use common::Rng;
use troupe::kernels::cuda::{
    DEEPSEEK_V4_SOURCE, GEMV_ROWS, INDEX_MAX_HEAD_DIM, INDEX_SMEM_BYTES, LLAMA_SOURCE,
    check_dsv4_shape, compile, compile_cubin, invariant_staged_fits,
};
use troupe::kernels::deepseek_v4::DsV4Shape;

#[test]
fn llama_kernels_compile_for_sm90_with_every_entry_point() {
    let ptx = compile(LLAMA_SOURCE, "compute_90").unwrap_or_else(|e| panic!("{e}"));
    for kernel in [
        "f32_to_bf16_kernel",
        "embedding_kernel",
        "add_bias_kernel",
        "segment_attention_kernel",
        "gelu_kernel",
        "rms_norm_kernel",
        "add_rms_norm_kernel",
        "add_kernel",
        "rope_kernel",
        "silu_mul_kernel",
        "copy_columns_kernel",
        "gather_rows_kernel",
        "kv_write_f32_kernel",
        "kv_write_bf16_kernel",
        "kv_write_fp8_kernel",
        "qkv_rope_cache_fp8_kernel",
        "attention_split_fp8_kernel",
        "attention_decode_mma_fp8_64_kernel",
        "flash_prefill_fp8_64_kernel",
        "flash_prefill_fp8_128_kernel",
        "attention_decode_mma_fp8_128_kernel",
        "qkv_rope_cache_f32_kernel",
        "qkv_rope_cache_bf16_kernel",
        "matmul_invariant_kernel",
        "sample_kernel",
        "random_bf16_kernel",
        "attention_split_f32_kernel",
        "attention_split_bf16_kernel",
        "attention_combine_kernel",
        "flash_prefill_64_kernel",
        "flash_prefill_128_kernel",
        "attention_decode_mma_64_kernel",
        "attention_decode_mma_128_kernel",
        "dequant_bf16_kernel",
        "embedding_packed_kernel",
        "quantize_fp8_rows_kernel",
        "gemv_fp8_mma_kernel",
        "gemv_fp8_mma_staged_kernel",
        "gemv_fp8_mma_silu_kernel",
        "gemv_q4k_mma_kernel",
        "gemv_q4_1_mma_kernel",
        "matmul_invariant_mv1_kernel",
        "matmul_invariant_mv2_kernel",
        "matmul_invariant_mv4_kernel",
        "matmul_invariant_wide_kernel",
        "matmul_invariant_splits_kernel",
        "matmul_invariant_fp8_mv1_kernel",
        "matmul_invariant_fp8_mv2_kernel",
        "matmul_invariant_fp8_mv4_kernel",
        "matmul_invariant_fp8_wide_kernel",
        "quantize_fp8_act_kernel",
        "random_mxfp4_kernel",
        "gemv_fp8_mma_rows_kernel",
    ] {
        assert!(
            ptx.contains(&format!(".entry {kernel}(")),
            "{kernel} missing from the PTX"
        );
    }
    let shaped = GEMV_ROWS
        .iter()
        .map(|m| format!("gemv_{m}_kernel"))
        .chain(GEMV_ROWS.iter().map(|m| format!("gemv_silu_{m}_kernel")))
        .chain(GEMV_ROWS.iter().map(|m| format!("gemv_fp8_{m}_kernel")))
        .chain(GEMV_ROWS.iter().map(|m| format!("gemv_ggml_{m}_kernel")));
    for kernel in shaped {
        assert!(
            ptx.contains(&format!(".entry {kernel}(")),
            "{kernel} missing from the PTX"
        );
    }
}

#[test]
fn deepseek_v4_kernels_compile_for_sm90_with_every_entry_point() {
    let ptx = compile(DEEPSEEK_V4_SOURCE, "compute_90").unwrap_or_else(|e| panic!("{e}"));
    for name in [
        "rope",
        "mhc_mix",
        "mhc_merge",
        "mhc_head",
        "expand",
        "swap",
        "compress_feed",
        "entry_finish",
        "index_scores",
        "topk",
        "attention",
        "attention_merge",
        "ring_write",
        "moe_route",
        "swiglu",
        "moe_combine",
        "moe_align",
        "moe_up_bf16_few",
        "moe_down_bf16_few",
        "moe_up_bf16_many",
        "moe_down_bf16_many",
        "moe_up_mxfp4_few",
        "moe_down_mxfp4_few",
        "moe_up_mxfp4_many",
        "moe_down_mxfp4_many",
        "moe_up_mxfp4_pipe",
        "moe_down_mxfp4_pipe",
        "moe_gemv_mma_up_mxfp4",
        "moe_gemv_mma_down_mxfp4",
        "attention_mma",
        "compress_keep",
        "take_picks",
        "embed",
    ] {
        let kernel = format!("dsv4_{name}_kernel");
        assert!(
            ptx.contains(&format!(".entry {kernel}(")),
            "{kernel} missing from the PTX"
        );
    }
}

#[test]
fn the_kernels_assemble_to_hopper_machine_code() {
    // What the backend loads: a CUBIN (an ELF image), so the driver does not JIT at start.
    let image = compile_cubin(LLAMA_SOURCE, "sm_90").unwrap_or_else(|e| panic!("{e}"));
    assert!(image.starts_with(b"\x7fELF"), "not an ELF image");
    assert!(
        image
            .windows(b"sample_kernel".len())
            .any(|w| w == b"sample_kernel"),
        "the image lacks sample_kernel"
    );
}

#[test]
fn a_broken_kernel_reports_the_compiler_log() {
    let err = compile(
        "extern \"C\" __global__ void k() { undeclared(); }",
        "compute_90",
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("undeclared"), "{err}");
}

/// The indexer's score kernel reads keys 4 floats at a time and keeps a row's queries and a
/// block's keys in shared memory: generated index shapes load exactly when they fit, and a
/// refusal names the dimension (the check runs when a DeepSeek-V4 model loads on CUDA).
#[test]
fn deepseek_v4_index_shapes_load_exactly_when_the_indexer_kernel_takes_them() {
    let mut rng = Rng(0x1d5);
    for _ in 0..2000 {
        let (heads, dim) = (1 + rng.below(128), 1 + rng.below(2 * INDEX_MAX_HEAD_DIM));
        let shape = DsV4Shape {
            hc_mult: 4,
            num_routed_experts: 256,
            num_experts_per_tok: 6,
            head_dim: 512,
            index_width: heads * dim,
            index_head_dim: dim,
        };
        let fits = heads * dim * 4 <= INDEX_SMEM_BYTES
            && dim <= INDEX_MAX_HEAD_DIM
            && dim.is_multiple_of(4);
        match check_dsv4_shape(&shape) {
            Ok(()) => assert!(fits, "{heads} heads of {dim} loaded"),
            Err(e) => {
                assert!(!fits, "{heads} heads of {dim} refused: {e}");
                let e = e.to_string();
                assert!(
                    e.contains("index_head_dim") || e.contains("index_n_heads"),
                    "{e}"
                );
            }
        }
    }
}

#[test]
fn the_staged_invariant_gemm_fits_hopper_and_steps_aside_on_an_a100() {
    // Per-block opt-in shared memory: H100/H200 232 448 bytes, A100 166 912. On Hopper the
    // staged variants must fit (more stages would not); elsewhere the launcher takes the
    // 16-row variant rather than failing to load the kernels.
    assert!(
        invariant_staged_fits(232_448),
        "the staged variants outgrew Hopper's shared memory"
    );
    assert!(
        !invariant_staged_fits(166_912),
        "an A100 would be asked for more than it has"
    );
}
