// Temperature and top-p (nucleus) sampling on the GPU, one block of 1024 threads per row.
//
// params holds three floats per row: the temperature T (<= 0: a greedy row, whose token
// argmax_rows already wrote, is left alone), top_p P, and u in [0, 1), the row's uniform
// draw (from the request's seed on the host, so a request's output does not depend on its
// batch). With w_i = exp((x_i - max) / T):
//   - P >= 1: the token is the first i whose cumulative weight passes u * sum(w);
//   - P < 1: the nucleus is every token with w_i >= tau, tau the largest threshold whose kept
//     mass still reaches P * sum(w) (found by bisection on (0, 1]: no sort, and ties at the
//     threshold stay together); the draw is made among them as above.
// Each thread owns a contiguous range of the vocabulary, so the cumulative sums are a block
// scan of per-thread sums followed by one walk inside the range that holds the target.

extern "C" __global__ void sample_rows(const bf16* logits, int vocab, const float* params, u32* out) {
    __shared__ float red[32];
    __shared__ float scan[1024];
    __shared__ int claimed;
    const int row = blockIdx.x;
    const float temperature = params[3 * row], top_p = params[3 * row + 1], u = params[3 * row + 2];
    if (!(temperature > 0.0f)) return;  // the same for the whole block
    const bf16* x = logits + (size_t)row * vocab;
    const int chunk = (vocab + blockDim.x - 1) / blockDim.x;
    const int lo = min((int)threadIdx.x * chunk, vocab), hi = min(lo + chunk, vocab);
    const float inv_t = 1.0f / temperature;

    float m = NEG_INF;
    for (int i = lo; i < hi; ++i) m = fmaxf(m, bf2f(x[i]));
    m = block_max(m, red);

    float tau = 0.0f;
    if (top_p < 1.0f) {
        float s = 0.0f;
        for (int i = lo; i < hi; ++i) s += __expf((bf2f(x[i]) - m) * inv_t);
        const float want = top_p * block_sum(s, red);
        // mass(t) = sum of w_i >= t falls as t grows; keep the largest t with mass(t) >= want.
        float keep = 0.0f, drop = 1.0f;
        for (int it = 0; it < 30; ++it) {
            const float mid = 0.5f * (keep + drop);
            float part = 0.0f;
            for (int i = lo; i < hi; ++i) {
                const float w = __expf((bf2f(x[i]) - m) * inv_t);
                if (w >= mid) part += w;
            }
            if (block_sum(part, red) >= want) keep = mid; else drop = mid;
        }
        tau = keep;
    }

    float s = 0.0f;
    for (int i = lo; i < hi; ++i) {
        const float w = __expf((bf2f(x[i]) - m) * inv_t);
        if (w >= tau) s += w;
    }
    // Inclusive scan of the per-thread sums (Hillis-Steele over the block).
    scan[threadIdx.x] = s;
    if (threadIdx.x == 0) claimed = 0;
    __syncthreads();
    for (int off = 1; off < blockDim.x; off <<= 1) {
        const float v = threadIdx.x >= off ? scan[threadIdx.x - off] : 0.0f;
        __syncthreads();
        scan[threadIdx.x] += v;
        __syncthreads();
    }
    const float before = threadIdx.x > 0 ? scan[threadIdx.x - 1] : 0.0f;
    const float upto = scan[threadIdx.x];
    const float target = u * scan[blockDim.x - 1];
    int last = -1;
    if (s > 0.0f && before <= target && target < upto) {
        float acc = before;
        for (int i = lo; i < hi; ++i) {
            const float w = __expf((bf2f(x[i]) - m) * inv_t);
            if (w < tau) continue;
            last = i;
            acc += w;
            if (acc > target) break;
        }
        out[row] = (u32)last;
        claimed = 1;
    }
    __syncthreads();
    // Rounding left the target past the last kept weight: take the last kept token.
    if (!claimed && s > 0.0f && upto >= scan[blockDim.x - 1]) {
        for (int i = lo; i < hi; ++i) {
            if (__expf((bf2f(x[i]) - m) * inv_t) >= tau) last = i;
        }
        if (last >= 0) out[row] = (u32)last;
    }
}
