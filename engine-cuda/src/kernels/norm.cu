// RMSNorm fused with the residual add that precedes it.
//
// One block per token row. With add != 0: residual <- bf16(residual + x) first (the residual
// stream is kept in bf16, as in transformers). Then out = bf16(bf16(r * rsqrt(mean(r^2) + eps)) * w),
// the two roundings of transformers' LlamaRMSNorm (normalise in f32, cast, scale by the weight).
extern "C" __global__ void add_rmsnorm(bf16* residual, const bf16* x, const bf16* w, bf16* out,
                                       int hidden, float eps, int add) {
    __shared__ float scratch[32];
    size_t row = blockIdx.x;
    bf16* r = residual + row * hidden;
    const bf16* xr = x + row * hidden;
    bf16* o = out + row * hidden;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float v = bf2f(r[i]);
        if (add) {
            v = bf2f(f2bf(v + bf2f(xr[i])));
            r[i] = f2bf(v);
        }
        ss += v * v;
    }
    float total = block_sum(ss, scratch);
    float inv = rsqrtf(total / (float)hidden + eps);
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float n = bf2f(f2bf(bf2f(r[i]) * inv));
        o[i] = f2bf(n * bf2f(w[i]));
    }
}
