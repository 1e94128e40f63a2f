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
// (unnormalised acc[HEAD_DIM], m, l) to `partial`, and the last block of the token's KV head
// to finish (a ticket counter in `split_done`) merges the splits: no second launch.
// The split count depends on the step's token count only, so a CUDA graph captured for a
// batch size replays correctly for any context lengths.
#define TILE 32
// K rows in shared memory are padded by one 4-byte word so that the 32 lanes, each reading
// its own key row at the same column, hit 32 different banks.
#define KPAD (HEAD_DIM + 2)

extern "C" __global__ void __launch_bounds__(32 * GROUP) paged_attention_split(
        const bf16* qkv, const bf16* k_cache, const bf16* v_cache, const int* pos, const int* tok_seq,
        const int* table_start, const int* block_tables, bf16* out, float* partial, unsigned* split_done,
        int n_heads, int n_kv, float scale, int splits, int first) {
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
        return;
    }
    // The splits that saw keys (begin < len) are the first `active`: they write their
    // unnormalised (acc, m, l); a split past the end of a short context writes nothing.
    int active = (len + per - 1) / per;
    const size_t stride = HEAD_DIM + 2;
    float* ph = partial + ((size_t)t * n_heads + head) * splits * stride;
    if (split < active) {
        float* pp = ph + split * stride;
        #pragma unroll
        for (int e = 0; e < EPL; e++) pp[lane * EPL + e] = acc[e];
        if (lane == 0) { pp[HEAD_DIM] = m; pp[HEAD_DIM + 1] = l; }
    }
    // The last block of (token, KV head) to finish merges the splits: the others' writes are
    // visible to it once it has seen their tickets (fence, then ticket; ticket, then fence).
    // It puts the counter back to zero for the next launch (graph replays included).
    __shared__ unsigned ticket;
    __threadfence();
    __syncthreads();
    unsigned* done = split_done + (size_t)t * n_kv + kvh;
    if (threadIdx.x == 0) ticket = atomicAdd(done, 1u);
    __syncthreads();
    if (ticket != (unsigned)splits - 1) return;
    __threadfence();
    // The merge, split by split in order: every active split has a finite max.
    float mm = NEG_INF;
    for (int s = 0; s < active; s++) mm = fmaxf(mm, __ldcg(ph + s * stride + HEAD_DIM));
    float num[EPL], den = 0.0f;
    #pragma unroll
    for (int e = 0; e < EPL; e++) num[e] = 0.0f;
    for (int s = 0; s < active; s++) {
        const float* ps = ph + s * stride;
        float w = __expf(__ldcg(ps + HEAD_DIM) - mm);
        #pragma unroll
        for (int e = 0; e < EPL; e++) num[e] += w * __ldcg(ps + lane * EPL + e);
        den += w * __ldcg(ps + HEAD_DIM + 1);
    }
    bf16* o = out + (size_t)t * n_heads * HEAD_DIM + head * HEAD_DIM + lane * EPL;
    #pragma unroll
    for (int e = 0; e < EPL; e++) o[e] = f2bf(num[e] / den);
    if (threadIdx.x == 0) *done = 0u;
}

#if HEAD_DIM <= 128
// Tiled prefill attention on the tensor cores, flash-attention style: the kernel for the
// prompt-chunk tokens of a step (decode tokens keep paged_attention_split). Needs HEAD_DIM
// (64 or 128), BLOCK_SIZE and GROUP defined.
//
// A tile is up to TC_ROWS consecutive tokens of one sequence's chunk (positions
// pos0 .. pos0 + rows - 1), planned on the host (StepLayout::prefill_tiles: pairs of first
// step token and row count, the heaviest first). Grid (query head, tile), 4 warps of 16
// query rows each. The block walks the keys 0 .. pos0 + rows - 1 of the sequence TC_KEYS at a
// time through its block table: K and V rows are copied into shared memory with cp.async
// (the V copy of tile j and the K copy of tile j + 1 overlap the math of tile j), S = Q·Kᵀ and
// O += P·V run as mma.sync m16n8k16 bf16 with f32 accumulators (K and V fragments through
// ldmatrix, V transposed), and the softmax is online in f32, one max per row and tile. The
// causal mask compares absolute positions, so a chunk over a cached prefix attends to the
// prefix and to the chunk's earlier tokens. Rows past `rows` compute on zeros and are not
// written; keys past the sequence's end are never read (their shared rows are zero-filled).
// Not built for HEAD_DIM 256 (K and V tiles would not fit static shared memory, nor the
// accumulators the registers): the split kernel serves those models' chunks.
#define TC_ROWS 64
#define TC_KEYS 64
// Shared K and V rows are padded by 16 bytes: the 8 row addresses of each ldmatrix then fall
// in 8 different 4-bank groups.
#define TC_PAD (HEAD_DIM + 8)
static_assert(TC_ROWS == 4 * 16, "four warps of 16 query rows (kv.rs PREFILL_TILE_ROWS)");

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned r;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(r) : "l"(p));
    return r;
}

// 16 bytes from global to shared memory, asynchronously; bytes == 0 writes zeros and reads nothing.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src, int bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory"); }

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned& r0, unsigned& r1, unsigned& r2, unsigned& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

// c (16×8 f32) += a (16×16 bf16, row-major) · b (16×8 bf16, column-major).
__device__ __forceinline__ void mma_bf16(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two floats as bf16x2, lo in the low half (the lower column of an mma fragment).
__device__ __forceinline__ unsigned pack_bf16(float lo, float hi) {
    unsigned r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

// Copies keys kbase .. kbase + TC_KEYS - 1 of one KV head (K or V) into `dst`, zeros past kv_len.
__device__ __forceinline__ void tc_load_tile(bf16* dst, const bf16* cache, const int* table, int kbase, int kv_len,
                                             int n_kv, int kvh) {
    const int chunks = HEAD_DIM / 8;
    #pragma unroll
    for (int i = 0; i < TC_KEYS * chunks / 128; i++) {
        int c = threadIdx.x + 128 * i;
        int r = c / chunks, col = (c % chunks) * 8;
        int key = kbase + r;
        const bf16* src = cache;
        int bytes = 0;
        if (key < kv_len) {
            long long slot = (long long)table[key / BLOCK_SIZE] * BLOCK_SIZE + (key % BLOCK_SIZE);
            src = cache + ((size_t)slot * n_kv + kvh) * HEAD_DIM + col;
            bytes = 16;
        }
        cp_async16(smem_u32(dst + r * TC_PAD + col), src, bytes);
    }
}

extern "C" __global__ void __launch_bounds__(128) prefill_attention_tc(
        const bf16* qkv, const bf16* k_cache, const bf16* v_cache, const int* pos, const int* tok_seq,
        const int* table_start, const int* block_tables, const int* tiles, bf16* out, int n_heads, int n_kv,
        float scale) {
    __shared__ __align__(16) bf16 sk[TC_KEYS * TC_PAD];
    __shared__ __align__(16) bf16 sv[TC_KEYS * TC_PAD];
    const int head = blockIdx.x, kvh = head / GROUP;
    const int first = tiles[2 * blockIdx.y], rows = tiles[2 * blockIdx.y + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tq = lane & 3;  // mma fragment row group and column pair
    const int pos0 = pos[first];
    const int kv_len = pos0 + rows;
    const int* table = block_tables + table_start[tok_seq[first]];
    const int qkv_dim = (n_heads + 2 * n_kv) * HEAD_DIM;

    // This warp's 16 query rows as A fragments (rows past the tile are zeros).
    const int r0 = warp * 16 + g, r1 = r0 + 8;
    unsigned qf[HEAD_DIM / 16][4];
    {
        const bf16* q0 = qkv + (size_t)(first + r0) * qkv_dim + head * HEAD_DIM + 2 * tq;
        const bf16* q1 = qkv + (size_t)(first + r1) * qkv_dim + head * HEAD_DIM + 2 * tq;
        #pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ks++) {
            qf[ks][0] = r0 < rows ? *(const unsigned*)(q0 + 16 * ks) : 0u;
            qf[ks][1] = r1 < rows ? *(const unsigned*)(q1 + 16 * ks) : 0u;
            qf[ks][2] = r0 < rows ? *(const unsigned*)(q0 + 16 * ks + 8) : 0u;
            qf[ks][3] = r1 < rows ? *(const unsigned*)(q1 + 16 * ks + 8) : 0u;
        }
    }
    // A row's last key: its own position, and never past the sequence's end (rows past the tile).
    const int lim0 = min(pos0 + r0, kv_len - 1), lim1 = min(pos0 + r1, kv_len - 1);
    // The warp has work in a key tile that starts at or before its last row's position.
    const bool warp_live = warp * 16 < rows;
    const int warp_last = pos0 + min(warp * 16 + 15, rows - 1);
    const float sl = scale * 1.4426950408889634f;  // scores in log2 units: exp2 below

    float o[HEAD_DIM / 8][4];
    #pragma unroll
    for (int i = 0; i < HEAD_DIM / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;
    float m0 = NEG_INF, m1 = NEG_INF, l0 = 0.0f, l1 = 0.0f;

    // Per-lane ldmatrix offsets (bf16 elements): K non-transposed (key rows, 8-dim halves),
    // V transposed (key rows, 8-dim column blocks).
    const int k_off = ((lane & 7) + ((lane >> 4) << 3)) * TC_PAD + (((lane >> 3) & 1) << 3);
    const int v_off = ((lane & 7) + (((lane >> 3) & 1) << 3)) * TC_PAD + ((lane >> 4) << 3);
    const unsigned sk_base = smem_u32(sk) + 2 * k_off, sv_base = smem_u32(sv) + 2 * v_off;

    const int n_tiles = (kv_len + TC_KEYS - 1) / TC_KEYS;
    tc_load_tile(sk, k_cache, table, 0, kv_len, n_kv, kvh);
    cp_async_commit();
    for (int it = 0; it < n_tiles; it++) {
        const int kbase = it * TC_KEYS;
        const bool active = warp_live && kbase <= warp_last;
        cp_async_wait<0>();
        __syncthreads();  // K(it) is in; every warp is done with V(it - 1)
        tc_load_tile(sv, v_cache, table, kbase, kv_len, n_kv, kvh);
        cp_async_commit();
        float s[TC_KEYS / 8][4];
        #pragma unroll
        for (int i = 0; i < TC_KEYS / 8; i++) s[i][0] = s[i][1] = s[i][2] = s[i][3] = 0.0f;
        if (active) {
            #pragma unroll
            for (int ks = 0; ks < HEAD_DIM / 16; ks++) {
                #pragma unroll
                for (int np = 0; np < TC_KEYS / 16; np++) {
                    unsigned b0, b1, b2, b3;
                    ldsm_x4(sk_base + 2 * (np * 16 * TC_PAD + ks * 16), b0, b1, b2, b3);
                    mma_bf16(s[2 * np], qf[ks], b0, b1);
                    mma_bf16(s[2 * np + 1], qf[ks], b2, b3);
                }
            }
        }
        __syncthreads();  // every warp is done with K(it)
        if (it + 1 < n_tiles) tc_load_tile(sk, k_cache, table, kbase + TC_KEYS, kv_len, n_kv, kvh);
        cp_async_commit();
        unsigned pf[TC_KEYS / 16][4];
        if (active) {
            // Scale, mask (only tiles that reach past the first row's position need it), row max.
            const bool mask = kbase + TC_KEYS - 1 > pos0;
            float mx0 = NEG_INF, mx1 = NEG_INF;
            #pragma unroll
            for (int nt = 0; nt < TC_KEYS / 8; nt++) {
                #pragma unroll
                for (int e = 0; e < 4; e++) {
                    int key = kbase + nt * 8 + 2 * tq + (e & 1);
                    float v = s[nt][e] * sl;
                    if (mask && key > (e < 2 ? lim0 : lim1)) v = NEG_INF;
                    s[nt][e] = v;
                }
                mx0 = fmaxf(mx0, fmaxf(s[nt][0], s[nt][1]));
                mx1 = fmaxf(mx1, fmaxf(s[nt][2], s[nt][3]));
            }
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
            mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
            mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
            // Key 0 is in every row's range and in the first tile, so the running max is
            // finite from the first tile on (a row whose keys in a later tile are all masked
            // keeps its max, and its p are 0).
            const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
            const float c0 = fast_exp2(m0 - mn0), c1 = fast_exp2(m1 - mn1);
            m0 = mn0;
            m1 = mn1;
            float ps0 = 0.0f, ps1 = 0.0f;
            #pragma unroll
            for (int nt = 0; nt < TC_KEYS / 8; nt++) {
                s[nt][0] = fast_exp2(s[nt][0] - mn0);
                s[nt][1] = fast_exp2(s[nt][1] - mn0);
                s[nt][2] = fast_exp2(s[nt][2] - mn1);
                s[nt][3] = fast_exp2(s[nt][3] - mn1);
                ps0 += s[nt][0] + s[nt][1];
                ps1 += s[nt][2] + s[nt][3];
            }
            // Per-lane partial sums: the quad's lanes share the max, so they add up at the end.
            l0 = l0 * c0 + ps0;
            l1 = l1 * c1 + ps1;
            #pragma unroll
            for (int i = 0; i < HEAD_DIM / 8; i++) {
                o[i][0] *= c0;
                o[i][1] *= c0;
                o[i][2] *= c1;
                o[i][3] *= c1;
            }
            // The score fragments of key columns 16kk .. 16kk + 15 are the A fragment of P·V.
            #pragma unroll
            for (int kk = 0; kk < TC_KEYS / 16; kk++) {
                pf[kk][0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
                pf[kk][1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
                pf[kk][2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
                pf[kk][3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            }
        }
        cp_async_wait<1>();
        __syncthreads();  // V(it) is in (K(it + 1) may still be on its way)
        if (active) {
            #pragma unroll
            for (int kk = 0; kk < TC_KEYS / 16; kk++) {
                #pragma unroll
                for (int dp = 0; dp < HEAD_DIM / 16; dp++) {
                    unsigned b0, b1, b2, b3;
                    ldsm_x4_t(sv_base + 2 * (kk * 16 * TC_PAD + dp * 16), b0, b1, b2, b3);
                    mma_bf16(o[2 * dp], pf[kk], b0, b1);
                    mma_bf16(o[2 * dp + 1], pf[kk], b2, b3);
                }
            }
        }
    }
    l0 += __shfl_xor_sync(0xffffffffu, l0, 1);
    l0 += __shfl_xor_sync(0xffffffffu, l0, 2);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 1);
    l1 += __shfl_xor_sync(0xffffffffu, l1, 2);
    const int out_stride = n_heads * HEAD_DIM;
    if (r0 < rows) {
        const float inv = 1.0f / l0;
        unsigned* dst = (unsigned*)(out + (size_t)(first + r0) * out_stride + head * HEAD_DIM + 2 * tq);
        #pragma unroll
        for (int i = 0; i < HEAD_DIM / 8; i++) dst[4 * i] = pack_bf16(o[i][0] * inv, o[i][1] * inv);
    }
    if (r1 < rows) {
        const float inv = 1.0f / l1;
        unsigned* dst = (unsigned*)(out + (size_t)(first + r1) * out_stride + head * HEAD_DIM + 2 * tq);
        #pragma unroll
        for (int i = 0; i < HEAD_DIM / 8; i++) dst[4 * i] = pack_bf16(o[i][2] * inv, o[i][3] * inv);
    }
}
#endif  // HEAD_DIM <= 128
