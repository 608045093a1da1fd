/* Paged decode attention for CPU workers: one pass over each sequence's blocks, read in place.
 *
 * The torch path gathers every block into a contiguous copy before the two einsums; on a CPU the decode step is
 * bound by memory traffic, so reading each K/V row exactly once (and never writing a copy) is what matters.
 * A work item is one sequence and a range of its kv heads. With all heads in one item, each cache block
 * (block_size rows of every kv head) is read front to back, which the hardware prefetcher follows; the next
 * block is prefetched by hand since blocks are scattered. Batches too small to keep every thread busy are split
 * by kv head instead. Softmax is online, rescaled once per block (as the split-KV GPU kernel does per segment).
 *
 * Layouts are those of kernels/torch_attention.py: q [B, H, D], cache [num_blocks, block_size, Hkv, D],
 * block_tables [B, max_blocks] int32, seq_lens [B] int32, out [B, H, D]; all float32 and contiguous.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEADS 64
#define MAX_HEAD_DIM 256
#define MAX_BLOCK_SIZE 64

int paged_attention_limits(int64_t num_heads, int64_t head_dim, int64_t block_size) {
    return num_heads <= MAX_HEADS && head_dim <= MAX_HEAD_DIM && block_size <= MAX_BLOCK_SIZE;
}

typedef struct {
    int64_t group, head_dim, block_size, row_stride, block_stride;
    float scale;
} Shape;

static void prefetch_block(const float *block, int64_t floats) {
    for (int64_t i = 0; i < floats; i += 16) __builtin_prefetch(block + i);
}

/* Heads [h0, h1) of one sequence; q and out point at the sequence's first query head. */
static void attend(const Shape *s, const float *q, const float *k_cache, const float *v_cache,
                   const int32_t *blocks, int64_t seq_len, int64_t h0, int64_t h1, float *out) {
    static __thread float qs[MAX_HEADS][MAX_HEAD_DIM], acc[MAX_HEADS][MAX_HEAD_DIM];
    static __thread float probs[MAX_HEADS][MAX_BLOCK_SIZE];
    float running_max[MAX_HEADS], denom[MAX_HEADS];
    const int64_t d_len = s->head_dim, q0 = h0 * s->group, q1 = h1 * s->group;
    for (int64_t i = q0; i < q1; ++i) {
        for (int64_t d = 0; d < d_len; ++d) qs[i][d] = q[i * d_len + d] * s->scale;
        memset(acc[i], 0, sizeof(float) * d_len);
        running_max[i] = -FLT_MAX; /* built with -ffast-math: no infinities; expf(-FLT_MAX - m) is 0 */
        denom[i] = 0.0f;
    }
    for (int64_t start = 0; start < seq_len; start += s->block_size) {
        const int64_t offset = (int64_t)blocks[start / s->block_size] * s->block_stride + h0 * d_len;
        const int64_t n = seq_len - start < s->block_size ? seq_len - start : s->block_size;
        if (start + s->block_size < seq_len) {
            const int64_t next = (int64_t)blocks[start / s->block_size + 1] * s->block_stride;
            prefetch_block(k_cache + next, s->block_stride);
            prefetch_block(v_cache + next, s->block_stride);
        }
        for (int64_t t = 0; t < n; ++t) {
            const float *key = k_cache + offset + t * s->row_stride;
            for (int64_t h = h0; h < h1; ++h) {
                const float *kh = key + (h - h0) * d_len;
                for (int64_t i = h * s->group; i < (h + 1) * s->group; ++i) {
                    float dot = 0.0f;
                    for (int64_t d = 0; d < d_len; ++d) dot += qs[i][d] * kh[d];
                    probs[i][t] = dot;
                }
            }
        }
        for (int64_t i = q0; i < q1; ++i) {
            float block_max = running_max[i];
            for (int64_t t = 0; t < n; ++t) block_max = probs[i][t] > block_max ? probs[i][t] : block_max;
            const float correction = expf(running_max[i] - block_max);
            float sum = 0.0f;
            for (int64_t t = 0; t < n; ++t) {
                probs[i][t] = expf(probs[i][t] - block_max);
                sum += probs[i][t];
            }
            denom[i] = denom[i] * correction + sum;
            running_max[i] = block_max;
            for (int64_t d = 0; d < d_len; ++d) acc[i][d] *= correction;
        }
        for (int64_t t = 0; t < n; ++t) {
            const float *value = v_cache + offset + t * s->row_stride;
            for (int64_t h = h0; h < h1; ++h) {
                const float *vh = value + (h - h0) * d_len;
                for (int64_t i = h * s->group; i < (h + 1) * s->group; ++i) {
                    const float p = probs[i][t];
                    for (int64_t d = 0; d < d_len; ++d) acc[i][d] += p * vh[d];
                }
            }
        }
    }
    for (int64_t i = q0; i < q1; ++i) {
        const float inv = 1.0f / denom[i];
        for (int64_t d = 0; d < d_len; ++d) out[i * d_len + d] = acc[i][d] * inv;
    }
}

void paged_decode_attention_f32(const float *q, const float *k_cache, const float *v_cache,
                                const int32_t *block_tables, const int32_t *seq_lens, float *out, int64_t batch,
                                int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                                int64_t max_blocks, float scale, int num_threads) {
    const int64_t row_stride = num_kv_heads * head_dim;
    const Shape s = {num_heads / num_kv_heads, head_dim, block_size, row_stride, block_size * row_stride, scale};
    const int64_t heads_per_item = batch >= 2 * num_threads ? num_kv_heads : 1;
    const int64_t items_per_seq = num_kv_heads / heads_per_item;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t w = 0; w < batch * items_per_seq; ++w) {
        const int64_t b = w / items_per_seq, h0 = (w % items_per_seq) * heads_per_item;
        attend(&s, q + b * num_heads * head_dim, k_cache, v_cache, block_tables + b * max_blocks, seq_lens[b], h0,
               h0 + heads_per_item, out + b * num_heads * head_dim);
    }
}
