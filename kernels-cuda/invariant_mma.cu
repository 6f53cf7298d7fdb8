// The batch-invariant GEMM on the tensor cores (after llama.cu and mma_tile.cu): C[m, n] =
// Σ_k X[m, k] · W[n, k], X f32, W bf16, C f32, through `tile_gemm` with K split four ways
// in a fixed order and f32-accurate activations (bf16 plus its bf16 remainder), 16-row
// tiles whatever M is: a row's sums never depend on how many rows share the launch
// (SGLang's fixed split, here with bf16 weights exact in the mma). Grid: (row tiles,
// 16-feature blocks).
extern "C" __global__ void __launch_bounds__(128)
    matmul_invariant_mma_kernel(float* C, const float* X, const bf16_t* W, int M, int N, int K) {
    pdl_enter();
    tile_gemm<1, 2, 4, TILE_BF16, false, true>(C, X, 1, nullptr, nullptr, nullptr, (const u64*)W,
                                               nullptr, M, N, K, 0.0f);
}
