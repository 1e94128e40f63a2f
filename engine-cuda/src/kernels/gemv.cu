// Bandwidth-bound matrix-vector products for steps of a few tokens (M <= GEMV_MAX_M rows),
// with the small kernels around them fused in. Needs HEAD_DIM defined.
//
// y[m][n] = sum_k x[m][k] * W[n][k] (W row-major [N][K], PyTorch's weight layout), f32
// accumulation, one bf16 rounding of the result: the row-major GEMM of Gpu::linear for few
// rows, where cuBLAS streams the weights below the memory's rate and every small kernel
// between two GEMMs costs a launch. At batch 1 a decode step is ~15 GB of weights read once:
// the work is moving bytes.
//
// A block of GEMV_WARPS warps, at most as many blocks as fit on the GPU at once (the host
// sizes the grid), each warp taking groups of two weight rows in turn. First the block
// stages the M input rows in shared memory (the prologue: a copy, or the RMSNorm of the
// residual stream) while its warps' first weight tiles are already on their way into L2
// (prefetch). Then a warp streams its two rows with 16-byte loads, lane l taking pieces l,
// l + 32, ... so a warp reads 512 contiguous bytes per row and load, GEMV_UNROLL pieces per
// row in flight; each piece meets the M staged input rows. The 2 x M sums are reduced over
// the warp and the epilogue writes them: a plain store, an add into the residual stream,
// SiLU(gate) * up (the warp's rows are gate row j and up row j), RoPE and the KV-cache write
// of the QKV projection (rows j and j + HEAD_DIM/2 of a head, the rotation's pair), or the
// logits with their greedy argmax.
//
// Every (m, n) is summed in the same order whatever M, the grid or the step, so replaying a
// captured step is bit-identical to running it eagerly, and a row's result does not depend
// on how many other rows the step has.
#define GEMV_WARPS 8
#define GEMV_UNROLL 4
#define GEMV_MAX_M 4

#define PRO_COPY 0   // x rows copied from `src` (row stride K)
#define PRO_NORM 1   // x = RMSNorm(src rows) * g, as add_rmsnorm rounds it (no add)

#define EPI_RESIDUAL 0  // y[m][n] = bf16(y[m][n] + bf16(acc)): the residual add of add_rmsnorm
#define EPI_SILU 1      // y[m][j] = bf16(bf16(silu(gate_j)) * up_j), as silu_mul (y rows of N/2)
#define EPI_ROPE_KV 2   // QKV: q rotated in place in y, k rotated and v into the KV caches
#define EPI_ARGMAX 3    // y[m][n] = acc (logits), and aux[m] = max over n of (logit, -n) packed

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 r;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(p));
    return r;
}

__device__ __forceinline__ void prefetch_l2(const void* p) {
    asm volatile("prefetch.global.L2 [%0];" :: "l"(p));
}

__device__ __forceinline__ float lo_bf(unsigned w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float hi_bf(unsigned w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ unsigned pack_bf(bf16 lo, bf16 hi) { return (unsigned)lo | ((unsigned)hi << 16); }

// acc += w . x over one 16-byte piece (8 bf16 each), x already widened.
__device__ __forceinline__ float dot8(uint4 w, const float* x, float acc) {
    acc = fmaf(lo_bf(w.x), x[0], acc);
    acc = fmaf(hi_bf(w.x), x[1], acc);
    acc = fmaf(lo_bf(w.y), x[2], acc);
    acc = fmaf(hi_bf(w.y), x[3], acc);
    acc = fmaf(lo_bf(w.z), x[4], acc);
    acc = fmaf(hi_bf(w.z), x[5], acc);
    acc = fmaf(lo_bf(w.w), x[6], acc);
    acc = fmaf(hi_bf(w.w), x[7], acc);
    return acc;
}

// The two weight rows of group g (of N / 2). For the QKV projection with RoPE the q and k
// groups pair dimension j of a head with j + HEAD_DIM/2 (the rotation's partner), v rows are
// consecutive; the gate/up projection pairs gate row j with up row j (N / 2 further); the
// others take consecutive rows.
template <int EPI>
__device__ __forceinline__ void group_rows(int g, int N, int n_heads, int n_kv, int* ra, int* rb) {
    if (EPI == EPI_ROPE_KV) {
        const int half = HEAD_DIM / 2;
        int qk_groups = (n_heads + n_kv) * half;
        if (g < qk_groups) {
            *ra = (g / half) * HEAD_DIM + g % half;
            *rb = *ra + half;
        } else {
            *ra = (n_heads + n_kv) * HEAD_DIM + 2 * (g - qk_groups);
            *rb = *ra + 1;
        }
    } else if (EPI == EPI_SILU) {
        *ra = g;
        *rb = g + N / 2;
    } else {
        *ra = 2 * g;
        *rb = 2 * g + 1;
    }
}

// A logit's place in the argmax order: larger values first, then lower indices (as
// argmax_rows and torch.argmax break ties); NaN never wins (0).
__device__ __forceinline__ unsigned long long argmax_key(float v, int n) {
    if (v != v) return 0ull;
    unsigned u = __float_as_uint(v);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
    return ((unsigned long long)u << 32) | (unsigned long long)(0xffffffffu - (unsigned)n);
}

template <int MM>
__device__ __forceinline__ void gemv_norm_prologue(uint4* xs, const bf16* src, const int* rows, const bf16* g,
                                                   float eps, int M, int K);

// Stages the block's M input rows (of K bf16) in shared memory `xs`, rows M..MM-1 zeroed.
// `rows` (may be null) picks the source row of each m.
template <int MM, int PRO>
__device__ __forceinline__ void gemv_prologue(uint4* xs, const bf16* src, const int* rows, const bf16* g, float eps,
                                              int M, int K) {
    if (PRO == PRO_NORM) {
        gemv_norm_prologue<MM>(xs, src, rows, g, eps, M, K);
        return;
    }
    const int K8 = K / 8;
    for (int i = threadIdx.x; i < MM * K8; i += blockDim.x) {
        int m = i / K8, c = i % K8;
        uint4 v = make_uint4(0u, 0u, 0u, 0u);
        if (m < M) v = ((const uint4*)(src + (rows ? (size_t)rows[m] : (size_t)m) * K))[c];
        xs[i] = v;
    }
}

// PRO_NORM: add_rmsnorm with add = 0. The rows are copied into `xs` with 16-byte loads all
// in flight at once (a strided loop of 2-byte loads and a block reduction per row took
// microseconds per row), summing squares on the way; one reduction for all rows (in a fixed
// order, so the same on every block); then the rows are normalised in place.
template <int MM>
__device__ __forceinline__ void gemv_norm_prologue(uint4* xs, const bf16* src, const int* rows, const bf16* g,
                                                   float eps, int M, int K) {
    __shared__ float red[MM][GEMV_WARPS];
    const int K8 = K / 8, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    float ss[MM];
    #pragma unroll
    for (int m = 0; m < MM; m++) ss[m] = 0.0f;
    #pragma unroll
    for (int m = 0; m < MM; m++) {
        const uint4* r = (const uint4*)(src + (m < M ? (rows ? (size_t)rows[m] : (size_t)m) : 0) * K);
        for (int c = threadIdx.x; c < K8; c += blockDim.x) {
            uint4 v = make_uint4(0u, 0u, 0u, 0u);
            if (m < M) v = r[c];
            xs[m * K8 + c] = v;
            unsigned vw[4] = {v.x, v.y, v.z, v.w};
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                float a = lo_bf(vw[e]), b = hi_bf(vw[e]);
                ss[m] += a * a;
                ss[m] += b * b;
            }
        }
    }
    #pragma unroll
    for (int m = 0; m < MM; m++) {
        float v = warp_sum(ss[m]);
        if (lane == 0) red[m][warp] = v;
    }
    __syncthreads();
    float inv[MM];
    #pragma unroll
    for (int m = 0; m < MM; m++) {
        float total = 0.0f;
        #pragma unroll
        for (int w = 0; w < GEMV_WARPS; w++) total += red[m][w];
        inv[m] = rsqrtf(total / (float)K + eps);
    }
    const uint4* gv = (const uint4*)g;
    for (int c = threadIdx.x; c < K8; c += blockDim.x) {
        uint4 ww = gv[c];
        unsigned gw[4] = {ww.x, ww.y, ww.z, ww.w};
        #pragma unroll
        for (int m = 0; m < MM; m++) {
            uint4 rr = xs[m * K8 + c];
            unsigned rw[4] = {rr.x, rr.y, rr.z, rr.w}, o[4];
            #pragma unroll
            for (int e = 0; e < 4; e++) {
                float n0 = bf2f(f2bf(lo_bf(rw[e]) * inv[m])), n1 = bf2f(f2bf(hi_bf(rw[e]) * inv[m]));
                o[e] = pack_bf(f2bf(n0 * lo_bf(gw[e])), f2bf(n1 * hi_bf(gw[e])));
            }
            // Rows past M stay zero.
            if (m < M) xs[m * K8 + c] = make_uint4(o[0], o[1], o[2], o[3]);
        }
    }
}

template <int MM, int PRO, int EPI>
__device__ __forceinline__ void gemv_body(const bf16* src, const int* rows, const bf16* g, float eps, const bf16* w,
                                          bf16* y, int M, int N, int K, const float* inv_freq, const int* pos,
                                          const long long* slots, bf16* k_cache, bf16* v_cache, int n_heads,
                                          int n_kv, unsigned long long* best) {
    extern __shared__ __align__(16) unsigned char gemv_smem[];
    __shared__ unsigned long long block_best[MM];
    uint4* xs = (uint4*)gemv_smem;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int K8 = K / 8, groups = N / 2, stride = gridDim.x * GEMV_WARPS;
    // The weights do not depend on the prologue: start the first tiles towards L2 now.
    int grp = blockIdx.x * GEMV_WARPS + warp;
    if (grp < groups) {
        int ra, rb;
        group_rows<EPI>(grp, N, n_heads, n_kv, &ra, &rb);
        #pragma unroll
        for (int u = 0; u < GEMV_UNROLL; u++) {
            int c = lane + 32 * u;
            if (c < K8) {
                prefetch_l2((const uint4*)(w + (size_t)ra * K) + c);
                prefetch_l2((const uint4*)(w + (size_t)rb * K) + c);
            }
        }
    }
    if (EPI == EPI_ARGMAX && threadIdx.x < MM) block_best[threadIdx.x] = 0ull;
    gemv_prologue<MM, PRO>(xs, src, rows, g, eps, M, K);
    __syncthreads();

    for (; grp < groups; grp += stride) {
        int ra, rb;
        group_rows<EPI>(grp, N, n_heads, n_kv, &ra, &rb);
        const uint4* wa = (const uint4*)(w + (size_t)ra * K);
        const uint4* wb = (const uint4*)(w + (size_t)rb * K);
        float acc0[MM], acc1[MM];
        #pragma unroll
        for (int m = 0; m < MM; m++) { acc0[m] = 0.0f; acc1[m] = 0.0f; }
        for (int c0 = lane; c0 < K8; c0 += 32 * GEMV_UNROLL) {
            uint4 va[GEMV_UNROLL], vb[GEMV_UNROLL];
            #pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) {
                int c = c0 + 32 * u;
                if (c < K8) {
                    va[u] = ld_stream(wa + c);
                    vb[u] = ld_stream(wb + c);
                } else {
                    va[u] = make_uint4(0u, 0u, 0u, 0u);
                    vb[u] = va[u];
                }
            }
            #pragma unroll
            for (int u = 0; u < GEMV_UNROLL; u++) {
                int c = c0 + 32 * u;
                if (c < K8) {
                    #pragma unroll
                    for (int m = 0; m < MM; m++) {
                        uint4 xx = xs[m * K8 + c];
                        float x[8] = {lo_bf(xx.x), hi_bf(xx.x), lo_bf(xx.y), hi_bf(xx.y),
                                      lo_bf(xx.z), hi_bf(xx.z), lo_bf(xx.w), hi_bf(xx.w)};
                        acc0[m] = dot8(va[u], x, acc0[m]);
                        acc1[m] = dot8(vb[u], x, acc1[m]);
                    }
                }
            }
        }
        #pragma unroll
        for (int m = 0; m < MM; m++) { acc0[m] = warp_sum(acc0[m]); acc1[m] = warp_sum(acc1[m]); }

        // Lane m writes token m's two results.
        #pragma unroll
        for (int m = 0; m < MM; m++) {
            if (lane != m || m >= M) continue;
            bf16 a = f2bf(acc0[m]), b = f2bf(acc1[m]);
            if (EPI == EPI_RESIDUAL) {
                bf16* ya = y + (size_t)m * N + ra;
                bf16* yb = y + (size_t)m * N + rb;
                *ya = f2bf(bf2f(*ya) + bf2f(a));
                *yb = f2bf(bf2f(*yb) + bf2f(b));
            } else if (EPI == EPI_SILU) {
                float gate = bf2f(a);
                float s = bf2f(f2bf(gate / (1.0f + __expf(-gate))));
                y[(size_t)m * (N / 2) + ra] = f2bf(s * bf2f(b));
            } else if (EPI == EPI_ARGMAX) {
                y[(size_t)m * N + ra] = a;
                y[(size_t)m * N + rb] = b;
                unsigned long long key = argmax_key(bf2f(a), ra);
                unsigned long long kb = argmax_key(bf2f(b), rb);
                atomicMax(&block_best[m], key > kb ? key : kb);
            } else {
                // As rope_kv_write, from the same bf16 projections.
                const int half = HEAD_DIM / 2;
                int qk_groups = (n_heads + n_kv) * half;
                long long slot = slots[m];
                if (grp < qk_groups) {
                    int head = grp / half, j = grp % half;
                    float s, c;
                    sincosf((float)pos[m] * inv_freq[j], &s, &c);
                    float cb = bf2f(f2bf(c)), sb = bf2f(f2bf(s));
                    float fa = bf2f(a), fb = bf2f(b);
                    bf16 lo = f2bf(bf2f(f2bf(fa * cb)) - bf2f(f2bf(fb * sb)));
                    bf16 hi = f2bf(bf2f(f2bf(fb * cb)) + bf2f(f2bf(fa * sb)));
                    if (head < n_heads) {
                        y[(size_t)m * N + ra] = lo;
                        y[(size_t)m * N + rb] = hi;
                    } else {
                        bf16* kc = k_cache + (slot * n_kv + (head - n_heads)) * HEAD_DIM;
                        kc[j] = lo;
                        kc[j + half] = hi;
                    }
                } else {
                    bf16* vc = v_cache + slot * n_kv * HEAD_DIM + (ra - (n_heads + n_kv) * HEAD_DIM);
                    vc[0] = a;
                    vc[1] = b;
                }
            }
        }
    }
    if (EPI == EPI_ARGMAX) {
        __syncthreads();
        if (threadIdx.x < M && threadIdx.x < MM) atomicMax(&best[threadIdx.x], block_best[threadIdx.x]);
    }
}

// One kernel per (M bound, prologue, epilogue) the forward pass uses; all take the same
// arguments (the RoPE and cache ones are read by EPI_ROPE_KV only, `best` by EPI_ARGMAX,
// `rows` and `g` by the prologues that use them). Block: 32 * GEMV_WARPS threads, MM * K * 2
// bytes of dynamic shared memory; grid: up to one block per 2 * GEMV_WARPS rows.
#define GEMV_KERNEL(name, MM, PRO, EPI)                                                                        \
    extern "C" __global__ void __launch_bounds__(32 * GEMV_WARPS) name(                                      \
            const bf16* src, const int* rows, const bf16* g, float eps, const bf16* w, bf16* y, int M, int N, \
            int K, const float* inv_freq, const int* pos, const long long* slots, bf16* k_cache,              \
            bf16* v_cache, int n_heads, int n_kv, unsigned long long* best) {                                 \
        gemv_body<MM, PRO, EPI>(src, rows, g, eps, w, y, M, N, K, inv_freq, pos, slots, k_cache, v_cache,     \
                                n_heads, n_kv, best);                                                         \
    }

#define GEMV_KERNELS(MM)                                          \
    GEMV_KERNEL(gemv_qkv_rope_m##MM, MM, PRO_NORM, EPI_ROPE_KV)   \
    GEMV_KERNEL(gemv_gate_up_m##MM, MM, PRO_NORM, EPI_SILU)       \
    GEMV_KERNEL(gemv_residual_m##MM, MM, PRO_COPY, EPI_RESIDUAL)  \
    GEMV_KERNEL(gemv_lm_head_m##MM, MM, PRO_NORM, EPI_ARGMAX)

GEMV_KERNELS(1)
GEMV_KERNELS(2)
GEMV_KERNELS(4)

// The greedy tokens from the LM head's argmax keys (EPI_ARGMAX), one thread per row; puts
// each key back to zero for the next step (graph replays included).
extern "C" __global__ void argmax_finalize(unsigned long long* best, u32* out, int rows) {
    int r = blockIdx.x * blockDim.x + threadIdx.x;
    if (r >= rows) return;
    out[r] = 0xffffffffu - (unsigned)(best[r] & 0xffffffffull);
    best[r] = 0ull;
}
