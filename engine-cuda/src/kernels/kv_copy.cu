// The KV of one sequence between the paged caches of every layer and a token-major buffer, for
// P/D hand-offs (executor/transfer.rs has the payload layout). `buf` holds tokens
// [first, first + gridDim.x) of the sequence as [token][layer][K, V][n_kv * HEAD_DIM]; token p
// of the sequence is in slot table[p / BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE of each layer's
// caches, a layer's caches `layer_elems` elements apart. Grid (tokens, layers, 2: K or V);
// each thread moves 16-byte pieces of one row (a row is a multiple of 64 elements: HEAD_DIM is
// 64, 128 or 256, and the caches' rows start 16-byte aligned).

__device__ __forceinline__ long long kv_row(const int* table, int p, int layer, long long layer_elems, int row) {
    long long slot = (long long)table[p / BLOCK_SIZE] * BLOCK_SIZE + (p % BLOCK_SIZE);
    return layer * layer_elems + slot * row;
}

__device__ __forceinline__ long long buf_row(int t, int layer, int layers, int which, int row) {
    return (((long long)t * layers + layer) * 2 + which) * row;
}

extern "C" __global__ void kv_gather(const bf16* __restrict__ k_cache, const bf16* __restrict__ v_cache,
                                     const int* __restrict__ table, int first, long long layer_elems, int n_kv,
                                     bf16* __restrict__ buf) {
    int t = blockIdx.x, layer = blockIdx.y, which = blockIdx.z, layers = gridDim.y;
    int row = n_kv * HEAD_DIM;
    const bf16* cache = which ? v_cache : k_cache;
    const uint4* src = (const uint4*)(cache + kv_row(table, first + t, layer, layer_elems, row));
    uint4* dst = (uint4*)(buf + buf_row(t, layer, layers, which, row));
    for (int i = threadIdx.x; i < row / 8; i += blockDim.x) dst[i] = src[i];
}

extern "C" __global__ void kv_scatter(bf16* __restrict__ k_cache, bf16* __restrict__ v_cache,
                                      const int* __restrict__ table, int first, long long layer_elems, int n_kv,
                                      const bf16* __restrict__ buf) {
    int t = blockIdx.x, layer = blockIdx.y, which = blockIdx.z, layers = gridDim.y;
    int row = n_kv * HEAD_DIM;
    bf16* cache = which ? v_cache : k_cache;
    uint4* dst = (uint4*)(cache + kv_row(table, first + t, layer, layer_elems, row));
    const uint4* src = (const uint4*)(buf + buf_row(t, layer, layers, which, row));
    for (int i = threadIdx.x; i < row / 8; i += blockDim.x) dst[i] = src[i];
}
