// Paged causal attention for decode tokens and prefill chunks alike. Needs HEAD_DIM and
// BLOCK_SIZE defined.
//
// One block of 4 warps per (token, query head). Token t of sequence s = tok_seq[t] sits at
// position pos[t] and attends to positions 0..=pos[t] of its sequence, read from the paged
// caches through the sequence's block table (block_tables[table_start[s] + position / BLOCK_SIZE]).
// Its own key and value, and those of the chunk before it, were written by rope_kv_write
// before this launch, so a prefill chunk over a cached prefix and a decode step are the same
// computation. Each warp takes every 4th key with an online softmax in f32 (each lane holds
// HEAD_DIM/32 contiguous dims, so a warp reads a key row in one coalesced sweep); the 4
// partial results are merged at the end.
#define EPL (HEAD_DIM / 32)
#define WARPS 4

extern "C" __global__ void __launch_bounds__(128) paged_attention(
        const bf16* qkv, const bf16* k_cache, const bf16* v_cache, const int* pos, const int* tok_seq,
        const int* table_start, const int* block_tables, bf16* out, int n_heads, int n_kv, float scale) {
    __shared__ float sm_m[WARPS], sm_l[WARPS];
    __shared__ float sm_acc[WARPS][HEAD_DIM];
    int t = blockIdx.x, head = blockIdx.y;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int kvh = head / (n_heads / n_kv);
    int qkv_dim = (n_heads + 2 * n_kv) * HEAD_DIM;
    const bf16* q = qkv + (size_t)t * qkv_dim + head * HEAD_DIM + lane * EPL;
    float qr[EPL], acc[EPL];
    #pragma unroll
    for (int e = 0; e < EPL; e++) { qr[e] = bf2f(q[e]) * scale; acc[e] = 0.0f; }
    const int* table = block_tables + table_start[tok_seq[t]];
    int len = pos[t] + 1;
    float m = NEG_INF, l = 0.0f;
    for (int j = warp; j < len; j += WARPS) {
        long long slot = (long long)table[j / BLOCK_SIZE] * BLOCK_SIZE + (j % BLOCK_SIZE);
        size_t off = ((size_t)slot * n_kv + kvh) * HEAD_DIM + lane * EPL;
        const bf16* k = k_cache + off;
        float d = 0.0f;
        #pragma unroll
        for (int e = 0; e < EPL; e++) d += qr[e] * bf2f(k[e]);
        float s = warp_sum(d);
        float m_new = fmaxf(m, s);
        float corr = __expf(m - m_new);
        float p = __expf(s - m_new);
        l = l * corr + p;
        const bf16* v = v_cache + off;
        #pragma unroll
        for (int e = 0; e < EPL; e++) acc[e] = acc[e] * corr + p * bf2f(v[e]);
        m = m_new;
    }
    if (lane == 0) { sm_m[warp] = m; sm_l[warp] = l; }
    #pragma unroll
    for (int e = 0; e < EPL; e++) sm_acc[warp][lane * EPL + e] = acc[e];
    __syncthreads();
    float mm = NEG_INF;
    #pragma unroll
    for (int w = 0; w < WARPS; w++) mm = fmaxf(mm, sm_m[w]);
    float total = 0.0f;
    float wgt[WARPS];
    #pragma unroll
    for (int w = 0; w < WARPS; w++) {
        // A warp that saw no key (len < WARPS) has m = -inf and weight 0.
        wgt[w] = sm_m[w] == NEG_INF ? 0.0f : __expf(sm_m[w] - mm);
        total += sm_l[w] * wgt[w];
    }
    bf16* o = out + (size_t)t * n_heads * HEAD_DIM + head * HEAD_DIM;
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        float v = 0.0f;
        #pragma unroll
        for (int w = 0; w < WARPS; w++) v += sm_acc[w][d] * wgt[w];
        o[d] = f2bf(v / total);
    }
}
