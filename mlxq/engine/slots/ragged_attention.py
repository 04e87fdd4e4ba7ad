"""Decode attention that reads only each row's own positions: one CUDA kernel.

The compiled decode forward attends every row over the cache's whole capacity, masked to
the row's length (:mod:`~mlxq.engine.slots.step`): with outputs of varied lengths most
of the keys and values it reads are masked away (a 1B model at 1,024 rows, rows of ~200
tokens in a capacity of 512: 2.5x the bytes that count). This kernel skips a masked
position before loading its key and value, so a step reads what the rows hold, and runs
as one launch a layer instead of the five of :func:`~mlxq.engine.slots.attention.gqa_decode`
(the host's launches are most of a CUDA step).

One block of 128 threads per (row, KV head) scores a chunk of positions at a time, one
thread a position, for all the query heads that share the KV head; an online softmax in
float32 carries the maxima from chunk to chunk; then the warps split the chunk's
positions, each lane adding its share of every head's weighted values (a value row is
read once per block). A chunk with no unmasked position is skipped, so a prefix mask
costs what the row holds. The mask is read as given (any pattern, not only a prefix).
Needs CUDA and a head size that is a multiple of 64.
"""

from __future__ import annotations

import mlx.core as mx

_HEADER = """
template <typename X> __device__ __forceinline__ void load8(const X* p, float* f) {
    for (int j = 0; j < 8; ++j) f[j] = static_cast<float>(p[j]);
}
template <> __device__ __forceinline__ void load8<__nv_bfloat16>(const __nv_bfloat16* p, float* f) {
    const uint4 raw = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* b = reinterpret_cast<const __nv_bfloat162*>(&raw);
    for (int j = 0; j < 4; ++j) {
        const float2 x = __bfloat1622float2(b[j]);
        f[2 * j] = x.x;
        f[2 * j + 1] = x.y;
    }
}
template <typename X> __device__ __forceinline__ float2 load2(const X* p) {
    return make_float2(static_cast<float>(p[0]), static_cast<float>(p[1]));
}
template <> __device__ __forceinline__ float2 load2<__nv_bfloat16>(const __nv_bfloat16* p) {
    return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(p));
}
"""

# One block of 128 threads per (row, KV head), a chunk of 128 positions at a time: each
# thread scores one position for every query head of the group (its key read whole), the
# block's maxima update the running softmax, then the warps split the chunk's positions
# and each lane adds its head_dim / 32 dims of the weighted values for every head (a value
# row is read once per block); the warps' sums are merged at the end. A chunk without an
# unmasked position is skipped whole; values are read up to its last unmasked one.
_SOURCE = """
    constexpr int NW = NT / 32, E = D / 32;
    const int t = threadIdx.x, lane = t & 31, warp = t >> 5;
    const int row = blockIdx.x / KVH, h = blockIdx.x % KVH;
    const int span = k_shape[2];
    __shared__ __align__(16) float qs[G][D];
    __shared__ float ps[NT][G];
    __shared__ float red[G][NW];
    __shared__ int ends[NW];
    __shared__ float sa[NW][G][D];
    for (int i = t; i < G * D; i += NT) {
        const int g = i / D, d = i % D;
        qs[g][d] = static_cast<float>(
            q[row * q_strides[0] + (h * G + g) * q_strides[1] + d * q_strides[3]]);
    }
    float run[G], part[G], acc[G][E];
    for (int g = 0; g < G; ++g) {
        run[g] = -1e30f;
        part[g] = 0.f;
        for (int e = 0; e < E; ++e) acc[g][e] = 0.f;
    }
    const T* kb = k + row * k_strides[0] + h * k_strides[1];
    const T* vb = v + row * v_strides[0] + h * v_strides[1] + lane * E;
    const bool* mb = mask + row * mask_strides[0];
    __syncthreads();
    for (int c0 = 0; c0 < span; c0 += NT) {
        const int p = c0 + t;
        const bool valid = p < span && mb[p * mask_strides[3]];
        float s[G];
        for (int g = 0; g < G; ++g) s[g] = -1e30f;
        if (valid) {
            for (int g = 0; g < G; ++g) s[g] = 0.f;
            const T* kr = kb + p * k_strides[2];
            for (int d = 0; d < D; d += 8) {
                float f[8];
                load8(kr + d, f);
                for (int g = 0; g < G; ++g)
                    for (int j = 0; j < 8; ++j) s[g] += qs[g][d + j] * f[j];
            }
        }
        int end = valid ? p + 1 : 0;
        for (int off = 16; off > 0; off >>= 1)
            end = max(end, __shfl_xor_sync(0xffffffff, end, off));
        for (int g = 0; g < G; ++g) {
            float x = s[g];
            for (int off = 16; off > 0; off >>= 1)
                x = fmaxf(x, __shfl_xor_sync(0xffffffff, x, off));
            if (lane == 0) red[g][warp] = x;
        }
        if (lane == 0) ends[warp] = end;
        __syncthreads();
        int last = 0;
        for (int w = 0; w < NW; ++w) last = max(last, ends[w]);
        if (last > 0) {
            for (int g = 0; g < G; ++g) {
                float top = run[g];
                for (int w = 0; w < NW; ++w) top = fmaxf(top, red[g][w]);
                const float corr = __expf(run[g] - top);
                run[g] = top;
                const float e = valid ? __expf(s[g] - top) : 0.f;
                ps[t][g] = e;
                part[g] = part[g] * corr + e;
                for (int i = 0; i < E; ++i) acc[g][i] *= corr;
            }
            __syncthreads();
            for (int j = warp; j < last - c0; j += NW) {
                float x[E];
                for (int e = 0; e < E; e += 2) {
                    const float2 y = load2(vb + (c0 + j) * v_strides[2] + e);
                    x[e] = y.x;
                    x[e + 1] = y.y;
                }
                for (int g = 0; g < G; ++g) {
                    const float w = ps[j][g];
                    for (int e = 0; e < E; ++e) acc[g][e] += w * x[e];
                }
            }
        }
        __syncthreads();
    }
    for (int g = 0; g < G; ++g) {
        float x = part[g];
        for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffff, x, off);
        if (lane == 0) red[g][warp] = x;
        for (int e = 0; e < E; ++e) sa[warp][g][lane * E + e] = acc[g][e];
    }
    __syncthreads();
    for (int i = t; i < G * D; i += NT) {
        const int g = i / D, d = i % D;
        float total = 0.f, o = 0.f;
        for (int w = 0; w < NW; ++w) {
            total += red[g][w];
            o += sa[w][g][d];
        }
        out[((row * KVH + h) * G + g) * D + d] = static_cast<T>(total > 0.f ? o / total : 0.f);
    }
"""

THREADS = 128  # a block's threads (the kernel's NT, a multiple of 32)
MAX_SHARED = 48 * 1024  # a block's static shared memory
_kernel = None  # built at first use (NVRTC compiles it then)


def supported(head_dim: int) -> bool:
    """Whether this kernel can run here for heads of ``head_dim`` values."""
    return mx.cuda.is_available() and head_dim % 64 == 0


def fits(group: int, head_dim: int) -> bool:
    """Whether one block's shared memory holds a KV head's ``group`` query heads of
    ``head_dim`` values (queries, a chunk's weights, the warps' maxima and sums)."""
    return 4 * group * (head_dim + THREADS + 4 + 4 * head_dim) + 16 <= MAX_SHARED


def ragged_decode(q: mx.array, k: mx.array, v: mx.array, scale: float, mask: mx.array) -> mx.array:
    """``softmax(q K^T * scale + mask) V`` for one query per row (the signature of
    :data:`~mlxq.engine.slots.attention.KERNELS`), reading only unmasked positions."""
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="mlxq_ragged_decode",
            input_names=["q", "k", "v", "mask"],
            output_names=["out"],
            source=_SOURCE,
            header=_HEADER,
            ensure_row_contiguous=False,  # (the cache's arrays as they are: never a copy)
        )
    rows, q_heads, _, dim = q.shape
    kv_heads = k.shape[1]
    (out,) = _kernel(
        inputs=[(q * scale).astype(k.dtype), k, v, mask],
        template=[
            ("T", k.dtype),
            ("D", dim),
            ("G", q_heads // kv_heads),
            ("KVH", kv_heads),
            ("NT", THREADS),
        ],
        grid=(rows * kv_heads * THREADS, 1, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, q_heads, 1, dim)],
        output_dtypes=[k.dtype],
    )
    return out
