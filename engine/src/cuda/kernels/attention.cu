// Paged causal attention for decode tokens and prefill chunks alike. Needs HEAD_DIM and
// BLOCK_SIZE defined.
//
// paged_attention is the first, simple kernel, kept as the reference the serving kernel
// (paged_attention_split, below) is checked against: one block of 4 warps per (token, query head). Token t of sequence s = tok_seq[t] sits at
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

// The serving kernel: paged attention split over the context (split-K), with the query
// heads of one KV head sharing each key and value read. Needs HEAD_DIM, BLOCK_SIZE and GROUP
// (query heads per KV head) defined.
//
// Grid (token, KV head, split); GROUP warps per block, warp g serving query head
// kv_head * GROUP + g. The token's keys 0..=pos[t] are cut into `splits` ranges of whole
// tiles; each block walks its range TILE keys at a time: the tile's K and V rows are loaded
// once into shared memory with 16-byte loads (coalesced: a key row of one KV head is
// HEAD_DIM contiguous bf16), then lane j of every warp scores key j of the tile against its
// head's query, the warp updates its online softmax in f32 with one max and one sum per
// tile, and accumulates the tile's values (lane owns EPL output dims). So KV bytes are read
// once per (token, KV head) rather than once per query head, and a decode token with a long
// context keeps the whole GPU busy through the splits.
//
// With splits == 1 the block normalises and writes its output. Otherwise it writes
// (unnormalised acc[HEAD_DIM], m, l) to `partial` and attention_combine merges the splits.
// The split count depends on the step's token count only, so a CUDA graph captured for a
// batch size replays correctly for any context lengths.
#define TILE 32
// K rows in shared memory are padded by one 4-byte word so that the 32 lanes, each reading
// its own key row at the same column, hit 32 different banks.
#define KPAD (HEAD_DIM + 2)

extern "C" __global__ void __launch_bounds__(32 * GROUP) paged_attention_split(
        const bf16* qkv, const bf16* k_cache, const bf16* v_cache, const int* pos, const int* tok_seq,
        const int* table_start, const int* block_tables, bf16* out, float* partial, int n_heads, int n_kv,
        float scale, int splits, int first) {
    __shared__ __align__(16) float sq[GROUP][HEAD_DIM];
    __shared__ __align__(16) bf16 sk[TILE][KPAD];
    __shared__ __align__(16) bf16 sv[TILE][HEAD_DIM];
    int t = first + blockIdx.x, kvh = blockIdx.y, split = blockIdx.z;
    int lane = threadIdx.x & 31, g = threadIdx.x >> 5;
    int head = kvh * GROUP + g;
    int qkv_dim = (n_heads + 2 * n_kv) * HEAD_DIM;
    const bf16* q = qkv + (size_t)t * qkv_dim + head * HEAD_DIM;
    for (int d = lane; d < HEAD_DIM; d += 32) sq[g][d] = bf2f(q[d]) * scale;
    int len = pos[t] + 1;
    int per = (len + splits - 1) / splits;
    per = (per + TILE - 1) / TILE * TILE;
    int begin = split * per;
    int end = min(len, begin + per);
    const int* table = block_tables + table_start[tok_seq[t]];
    float m = NEG_INF, l = 0.0f;
    float acc[EPL];
    #pragma unroll
    for (int e = 0; e < EPL; e++) acc[e] = 0.0f;
    const int chunks = HEAD_DIM / 8;  // 16-byte pieces of a row
    for (int base = begin; base < end; base += TILE) {
        // Every warp is done with the previous tile (and sq is written, the first time).
        __syncthreads();
        for (int c = threadIdx.x; c < TILE * chunks; c += blockDim.x) {
            int r = c / chunks, col = (c % chunks) * 8;
            int j = base + r;
            uint4 kk = make_uint4(0u, 0u, 0u, 0u), vv = make_uint4(0u, 0u, 0u, 0u);
            if (j < end) {
                long long slot = (long long)table[j / BLOCK_SIZE] * BLOCK_SIZE + (j % BLOCK_SIZE);
                size_t off = ((size_t)slot * n_kv + kvh) * HEAD_DIM + col;
                kk = *(const uint4*)(k_cache + off);
                vv = *(const uint4*)(v_cache + off);
            }
            // Padded K rows are only 4-byte aligned: four word stores.
            unsigned* dk = (unsigned*)&sk[r][col];
            dk[0] = kk.x; dk[1] = kk.y; dk[2] = kk.z; dk[3] = kk.w;
            *(uint4*)&sv[r][col] = vv;
        }
        __syncthreads();
        float s = NEG_INF;
        if (base + lane < end) {
            const unsigned* kr = (const unsigned*)&sk[lane][0];
            const float2* qg = (const float2*)&sq[g][0];
            float d = 0.0f;
            #pragma unroll 16
            for (int i = 0; i < HEAD_DIM / 2; i++) {
                unsigned w = kr[i];
                float2 qq = qg[i];
                d += qq.x * __uint_as_float(w << 16) + qq.y * __uint_as_float(w & 0xffff0000u);
            }
            s = d;
        }
        // The tile has at least one key in range (base < end), so m_new is finite.
        float m_new = fmaxf(m, warp_max(s));
        float corr = __expf(m - m_new);
        float p = s == NEG_INF ? 0.0f : __expf(s - m_new);
        l = l * corr + warp_sum(p);
        #pragma unroll
        for (int e = 0; e < EPL; e++) acc[e] *= corr;
        #pragma unroll 4
        for (int jj = 0; jj < TILE; jj++) {
            float pj = __shfl_sync(0xffffffffu, p, jj);
            const unsigned* vr = (const unsigned*)&sv[jj][lane * EPL];
            #pragma unroll
            for (int e = 0; e < EPL / 2; e++) {
                unsigned w = vr[e];
                acc[2 * e] += pj * __uint_as_float(w << 16);
                acc[2 * e + 1] += pj * __uint_as_float(w & 0xffff0000u);
            }
        }
        m = m_new;
    }
    if (splits == 1) {
        // len >= 1, so the one split saw a key and l > 0.
        float inv = 1.0f / l;
        bf16* o = out + (size_t)t * n_heads * HEAD_DIM + head * HEAD_DIM + lane * EPL;
        #pragma unroll
        for (int e = 0; e < EPL; e++) o[e] = f2bf(acc[e] * inv);
    } else {
        // A split past the end of a short context saw no key: m = -inf, l = 0, acc = 0.
        float* pp = partial + (((size_t)t * n_heads + head) * splits + split) * (HEAD_DIM + 2);
        #pragma unroll
        for (int e = 0; e < EPL; e++) pp[lane * EPL + e] = acc[e];
        if (lane == 0) { pp[HEAD_DIM] = m; pp[HEAD_DIM + 1] = l; }
    }
}

// Merges the splits of paged_attention_split: grid (token, query head), HEAD_DIM threads.
extern "C" __global__ void attention_combine(const float* partial, bf16* out, int n_heads, int splits) {
    int t = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    const float* p = partial + ((size_t)t * n_heads + head) * splits * (HEAD_DIM + 2);
    float mm = NEG_INF;
    for (int s = 0; s < splits; s++) mm = fmaxf(mm, p[s * (HEAD_DIM + 2) + HEAD_DIM]);
    float num = 0.0f, den = 0.0f;
    for (int s = 0; s < splits; s++) {
        const float* ps = p + s * (HEAD_DIM + 2);
        float ms = ps[HEAD_DIM];
        if (ms == NEG_INF) continue;
        float w = __expf(ms - mm);
        num += w * ps[d];
        den += w * ps[HEAD_DIM + 1];
    }
    out[(size_t)t * n_heads * HEAD_DIM + head * HEAD_DIM + d] = f2bf(num / den);
}
