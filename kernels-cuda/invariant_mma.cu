// The batch-invariant GEMM on the tensor cores (after llama.cu and mma_tile.cu): C[m, n] =
// Σ_k X[m, k] · W[n, k], X f32, W bf16, C f32, through `tile_gemm` with K split four ways
// in a fixed order and f32-accurate activations (bf16 plus its bf16 remainder). A row's
// sums run the same way in both shapes — 16-row tiles for a few rows, 64-row ones for
// more — so its result never depends on how many rows share the launch (SGLang's fixed
// split, here with bf16 weights exact in the mma).
extern "C" __global__ void __launch_bounds__(128)
    matmul_invariant_mma_few_kernel(float* C, const float* X, const bf16_t* W, int M, int N, int K) {
    pdl_enter();
    tile_gemm<1, 2, 4, TILE_BF16, false, true>(C, X, 1, nullptr, nullptr, nullptr, (const u64*)W,
                                               nullptr, M, N, K, 0.0f);
}

extern "C" __global__ void __launch_bounds__(128)
    matmul_invariant_mma_wide_kernel(float* C, const float* X, const bf16_t* W, int M, int N, int K) {
    pdl_enter();
    tile_gemm<4, 2, 4, TILE_BF16, false, true>(C, X, 1, nullptr, nullptr, nullptr, (const u64*)W,
                                               nullptr, M, N, K, 0.0f);
}
