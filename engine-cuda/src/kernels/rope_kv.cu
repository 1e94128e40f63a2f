// RoPE on the query and key heads of each token, and the write of its key and value into the
// paged KV cache. Needs HEAD_DIM defined.
//
// qkv rows are [q (n_heads*HEAD_DIM) | k (n_kv*HEAD_DIM) | v (n_kv*HEAD_DIM)]; q is rotated in
// place, k and v go to slot slots[t] of this layer's caches (laid out [slot][n_kv][HEAD_DIM],
// slot = block * block_size + offset in block). Rotation pairs (i, i + HEAD_DIM/2) as in
// transformers' rotate_half, with cos and sin rounded to bf16 and each product rounded, as
// there.
extern "C" __global__ void rope_kv_write(bf16* qkv, const float* inv_freq, const int* pos, const long long* slots,
                                         bf16* k_cache, bf16* v_cache, int n_heads, int n_kv) {
    const int half = HEAD_DIM / 2;
    size_t t = blockIdx.x;
    int qkv_dim = (n_heads + 2 * n_kv) * HEAD_DIM;
    bf16* row = qkv + t * qkv_dim;
    float p = (float)pos[t];
    long long slot = slots[t];
    int rot = (n_heads + n_kv) * half;
    for (int i = threadIdx.x; i < rot; i += blockDim.x) {
        int head = i / half, j = i % half;
        float s, c;
        sincosf(p * inv_freq[j], &s, &c);
        float cb = bf2f(f2bf(c)), sb = bf2f(f2bf(s));
        bf16* h = row + head * HEAD_DIM;
        float a = bf2f(h[j]), b = bf2f(h[j + half]);
        bf16 lo = f2bf(bf2f(f2bf(a * cb)) - bf2f(f2bf(b * sb)));
        bf16 hi = f2bf(bf2f(f2bf(b * cb)) + bf2f(f2bf(a * sb)));
        if (head < n_heads) {
            h[j] = lo;
            h[j + half] = hi;
        } else {
            bf16* k = k_cache + (slot * n_kv + (head - n_heads)) * HEAD_DIM;
            k[j] = lo;
            k[j + half] = hi;
        }
    }
    const bf16* v = row + (n_heads + n_kv) * HEAD_DIM;
    bf16* vc = v_cache + slot * n_kv * HEAD_DIM;
    for (int i = threadIdx.x; i < n_kv * HEAD_DIM; i += blockDim.x) vc[i] = v[i];
}
