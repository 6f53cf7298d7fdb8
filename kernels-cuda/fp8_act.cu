// Activations quantized to FP8 e4m3 for cuBLASLt's FP8 GEMM (appended to llama.cu's source
// after packed.cu, whose f32_to_e4m3 it shares with the weight quantizer): a block a row of
// x, each scale mapping its group's largest magnitude onto 448, as DeepSeek and vLLM quantize
// activations at run time. `group` 128: a scale for every 128 columns, stored as cuBLASLt's
// VEC128_32F layout wants them (N-major: scales[g · rows4 + r]); `group` 0: one scale for the
// whole row (OUTER_VEC_32F). Rows m .. rows4 pad the GEMM's N to a multiple of 4 with zeros.
extern "C" __global__ void __launch_bounds__(256)
    quantize_fp8_act_kernel(u8* xq, float* scales, const float* x, int m, int rows4, int K,
                            int group) {
    pdl_enter();
    __shared__ float scratch[32];
    long long r = blockIdx.x;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (r >= m) {
        for (int k = threadIdx.x * 4; k < K; k += blockDim.x * 4)
            *reinterpret_cast<u32*>(xq + r * K + k) = 0u;
        if (group == 0 && threadIdx.x == 0) scales[r] = 1.0f;
        for (int g = threadIdx.x; group != 0 && g < K / group; g += blockDim.x)
            scales[(long long)g * rows4 + r] = 1.0f;
        return;
    }
    const float* row = x + r * K;
    if (group == 128) {
        // A warp a group: each lane holds 4 of its 128 values.
        for (int g = warp; g < K / 128; g += blockDim.x >> 5) {
            float4 v = *reinterpret_cast<const float4*>(row + g * 128 + lane * 4);
            float amax = warp_max(fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
            float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
            u32 q = (u32)f32_to_e4m3(v.x / scale) | ((u32)f32_to_e4m3(v.y / scale) << 8) |
                    ((u32)f32_to_e4m3(v.z / scale) << 16) | ((u32)f32_to_e4m3(v.w / scale) << 24);
            *reinterpret_cast<u32*>(xq + r * K + g * 128 + lane * 4) = q;
            if (lane == 0) scales[(long long)g * rows4 + r] = scale;
        }
        return;
    }
    float amax = 0.0f;
    for (int k = threadIdx.x * 4; k < K; k += blockDim.x * 4) {
        float4 v = *reinterpret_cast<const float4*>(row + k);
        amax = fmaxf(amax, fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w))));
    }
    amax = block_max(amax, scratch);
    float scale = amax > 0.0f ? amax / 448.0f : 1.0f;
    if (threadIdx.x == 0) scales[r] = scale;
    for (int k = threadIdx.x * 4; k < K; k += blockDim.x * 4) {
        float4 v = *reinterpret_cast<const float4*>(row + k);
        u32 q = (u32)f32_to_e4m3(v.x / scale) | ((u32)f32_to_e4m3(v.y / scale) << 8) |
                ((u32)f32_to_e4m3(v.z / scale) << 16) | ((u32)f32_to_e4m3(v.w / scale) << 24);
        *reinterpret_cast<u32*>(xq + r * K + k) = q;
    }
}
