/* Paged decode attention for CPU workers: one pass over each sequence's blocks, read in place.
 *
 * The torch path gathers every block into a contiguous copy before the two einsums; on a CPU the decode step is
 * bound by memory traffic, so reading each K/V row once (and never writing a copy) is what matters, and then
 * the arithmetic: the library is compiled for one HEAD_DIM and GROUP (query heads per kv head, -D flags), so
 * the inner loops unroll into whole vectors and each (kv head, block) pass keeps its GROUP x HEAD_DIM
 * accumulator in registers while it walks the block's tokens.
 *
 * A work item is one sequence and a range of its kv heads. With all heads in one item, each cache block
 * (block_size rows of every kv head) is read front to back; the next block is prefetched by hand since blocks
 * are scattered. Batches too small to keep every thread busy are split by kv head instead. Softmax is online,
 * rescaled once per block (as the split-KV GPU kernel does per segment).
 *
 * A sliding window (`window` > 0: the query sees its last `window` tokens) starts the walk at the window's first
 * token, mid-block if need be, so the blocks before it are never read; a soft-cap (`softcap` > 0, Gemma 2) turns
 * each score s into softcap * tanh(s / softcap) before the softmax.
 *
 * Layouts are those of kernels/torch_attention.py: q [B, H, D], cache [num_blocks, block_size, Hkv, D],
 * block_tables [B, max_blocks] int32, seq_lens [B] int32, out [B, H, D]; all contiguous. q and out are float32, or
 * both bfloat16 (`bf16_io`: q widened as it is read, out rounded to nearest even once, as torch's conversions do;
 * the conversions in torch cost more than the attention of a short sequence).
 * The cache's format is chosen when building (-DKV_FORMAT): float32; bfloat16, each K/V element widened to
 * float32 as it is read (a shift, vectorized with the loop), so a bf16 cache halves the memory traffic and every
 * product, the softmax and the accumulator stay in float32 (AVX-512 BF16's dot-product instruction is not used:
 * the loop is bound by the loads, and it would round the probabilities to bf16 before they weight V; the gain is
 * measured by scripts/bench_cpu_dtypes.py, docs/benchmarks.md); or int8 / fp8 e4m3 with one float32 scale per token and kv
 * head (kernels/kv_quant.py; scales [num_blocks, block_size, Hkv]). A quantized element is widened exactly
 * (int8 by conversion, e4m3 by moving its exponent and mantissa bits into a float32's), and the scales never
 * touch the D-wide rows: a key's scale multiplies its score, a value's scale the probability that weighs it.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if !defined(HEAD_DIM) || !defined(GROUP)
#error "compile with -DHEAD_DIM=<head dim> -DGROUP=<query heads per kv head>"
#endif

#define KV_FLOAT32 0
#define KV_BFLOAT16 1
#define KV_INT8 2
#define KV_FP8_E4M3 3
#ifndef KV_FORMAT
#define KV_FORMAT KV_FLOAT32
#endif
#define QUANTIZED (KV_FORMAT == KV_INT8 || KV_FORMAT == KV_FP8_E4M3)

typedef union {
    uint32_t bits;
    float value;
} f32_bits;

static inline float bf16_to_float(uint16_t x) { /* bfloat16: the upper half of a float32 */
    const f32_bits b = {(uint32_t)x << 16};
    return b.value;
}

#if KV_FORMAT == KV_BFLOAT16
typedef uint16_t kv_t;
static inline float kv_load(const kv_t *p, int64_t i) { return bf16_to_float(p[i]); }
#elif KV_FORMAT == KV_INT8
typedef int8_t kv_t;
static inline float kv_load(const kv_t *p, int64_t i) { return (float)p[i]; }
#elif KV_FORMAT == KV_FP8_E4M3
typedef uint8_t kv_t; /* e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities */
static inline float kv_load(const kv_t *p, int64_t i) {
    const uint32_t magnitude = p[i] & 0x7F;
    /* A normal value's exponent and mantissa, shifted into a float32's and rebiased (7 -> 127); a subnormal one
     * (exponent 0) is its mantissa times 2^-9. The cache never holds the NaN pattern (writes saturate at 448). */
    const f32_bits normal = {(magnitude << 20) + (120u << 23)};
    const float value = magnitude >= 8 ? normal.value : (float)magnitude * 0x1p-9f;
    return p[i] & 0x80 ? -value : value;
}
#else
typedef float kv_t;
static inline float kv_load(const kv_t *p, int64_t i) { return p[i]; }
#endif
#define MAX_KV_HEADS 16
#define MAX_BLOCK_SIZE 64

int paged_attention_limits(int64_t num_kv_heads, int64_t block_size) {
    return num_kv_heads <= MAX_KV_HEADS && block_size <= MAX_BLOCK_SIZE;
}

typedef struct {
    int64_t block_size, row_stride, block_stride, num_kv_heads, window;
    float scale, softcap;
    int bf16_io;
} Shape;

static inline uint16_t float_to_bf16(float x) { /* round to nearest even; the kernel makes no NaNs */
    const f32_bits b = {.value = x};
    return (uint16_t)((b.bits + 0x7FFFu + ((b.bits >> 16) & 1u)) >> 16);
}

typedef struct {
    float q[GROUP][HEAD_DIM], acc[GROUP][HEAD_DIM], probs[GROUP][MAX_BLOCK_SIZE];
    float running_max[GROUP], denom[GROUP];
} HeadState;

static void prefetch(const void *start, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)start + i);
}

/* One kv head over n consecutive tokens of a block: scores, online softmax, then V into the registers'
 * accumulator. For a quantized cache, k_scales/v_scales point at the first token's scales (stride num_kv_heads);
 * otherwise they are unused. */
static inline void attend_block(HeadState *st, const kv_t *keys, const kv_t *values, const float *k_scales,
                                const float *v_scales, int64_t n, int64_t row_stride, int64_t scale_stride,
                                float softcap) {
    for (int64_t t = 0; t < n; ++t) {
        const kv_t *key = keys + t * row_stride;
        float k[HEAD_DIM];
        for (int d = 0; d < HEAD_DIM; ++d) k[d] = kv_load(key, d);
        for (int g = 0; g < GROUP; ++g) {
            float dot = 0.0f;
            for (int d = 0; d < HEAD_DIM; ++d) dot += st->q[g][d] * k[d];
#if QUANTIZED
            dot *= k_scales[t * scale_stride];
#endif
            st->probs[g][t] = dot;
        }
    }
    if (softcap > 0.0f) { /* q carries the scale: these are the scaled scores */
        for (int g = 0; g < GROUP; ++g)
            for (int64_t t = 0; t < n; ++t) st->probs[g][t] = softcap * tanhf(st->probs[g][t] / softcap);
    }
    float acc[GROUP][HEAD_DIM];
    for (int g = 0; g < GROUP; ++g) {
        float block_max = st->running_max[g];
        for (int64_t t = 0; t < n; ++t) block_max = st->probs[g][t] > block_max ? st->probs[g][t] : block_max;
        const float correction = expf(st->running_max[g] - block_max);
        float sum = 0.0f;
        for (int64_t t = 0; t < n; ++t) {
            st->probs[g][t] = expf(st->probs[g][t] - block_max);
            sum += st->probs[g][t];
        }
        st->denom[g] = st->denom[g] * correction + sum;
        st->running_max[g] = block_max;
        for (int d = 0; d < HEAD_DIM; ++d) acc[g][d] = st->acc[g][d] * correction;
    }
    for (int64_t t = 0; t < n; ++t) {
        const kv_t *value = values + t * row_stride;
        float v[HEAD_DIM];
        for (int d = 0; d < HEAD_DIM; ++d) v[d] = kv_load(value, d);
#if QUANTIZED
        const float v_scale = v_scales[t * scale_stride];
#else
        const float v_scale = 1.0f;
#endif
        for (int g = 0; g < GROUP; ++g) {
            const float p = st->probs[g][t] * v_scale;
            for (int d = 0; d < HEAD_DIM; ++d) acc[g][d] += p * v[d];
        }
    }
    memcpy(st->acc, acc, sizeof(acc));
}

/* One kv head's query heads out: the accumulator over the softmax's denominator. A function of its own, never
 * inlined: inlined into a loop over heads, the compiler vectorizes the divisions across heads (-ffast-math: an
 * approximate reciprocal refined once) where one head alone is divided exactly, and a head's result would depend
 * on whether its work item holds one head or all of them, which the batch's size decides (--batch-invariant). */
static __attribute__((noinline)) void finish_head(const HeadState *st, void *out, int bf16_io) {
    for (int g = 0; g < GROUP; ++g) {
        const float inv = 1.0f / st->denom[g];
        if (bf16_io)
            for (int d = 0; d < HEAD_DIM; ++d) ((uint16_t *)out)[g * HEAD_DIM + d] = float_to_bf16(st->acc[g][d] * inv);
        else
            for (int d = 0; d < HEAD_DIM; ++d) ((float *)out)[g * HEAD_DIM + d] = st->acc[g][d] * inv;
    }
}

/* Kv heads [h0, h1) of one sequence; q and out point at the sequence's first query head. */
static void attend(const Shape *s, const void *q, const kv_t *k_cache, const kv_t *v_cache, const float *k_scales,
                   const float *v_scales, const int32_t *blocks, int64_t seq_len, int64_t h0, int64_t h1,
                   void *out) {
    HeadState heads[MAX_KV_HEADS];
    for (int64_t h = h0; h < h1; ++h) {
        HeadState *st = &heads[h - h0];
        for (int g = 0; g < GROUP; ++g) {
            const int64_t first = (h * GROUP + g) * HEAD_DIM;
            for (int d = 0; d < HEAD_DIM; ++d)
                st->q[g][d] = (s->bf16_io ? bf16_to_float(((const uint16_t *)q)[first + d])
                                          : ((const float *)q)[first + d]) * s->scale;
            memset(st->acc[g], 0, sizeof(st->acc[g]));
            st->running_max[g] = -FLT_MAX; /* built with -ffast-math: no infinities; expf(-FLT_MAX - m) is 0 */
            st->denom[g] = 0.0f;
        }
    }
    const int64_t first = s->window > 0 && seq_len > s->window ? seq_len - s->window : 0; /* first token seen */
    for (int64_t start = first - first % s->block_size; start < seq_len; start += s->block_size) {
        const int64_t skip = start < first ? first - start : 0; /* rows of the window's first block before it */
        const int64_t row = (int64_t)blocks[start / s->block_size] * s->block_size + skip; /* its first slot */
        const int64_t offset = row * s->row_stride;
        const int64_t n = (seq_len - start < s->block_size ? seq_len - start : s->block_size) - skip;
        if (start + s->block_size < seq_len) {
            const int64_t next = blocks[start / s->block_size + 1];
            prefetch(k_cache + next * s->block_stride, s->block_stride * (int64_t)sizeof(kv_t));
            prefetch(v_cache + next * s->block_stride, s->block_stride * (int64_t)sizeof(kv_t));
#if QUANTIZED
            const int64_t scales = s->block_size * s->num_kv_heads;
            prefetch(k_scales + next * scales, scales * (int64_t)sizeof(float));
            prefetch(v_scales + next * scales, scales * (int64_t)sizeof(float));
#endif
        }
        for (int64_t h = h0; h < h1; ++h) {
            /* At full precision the scale pointers are NULL and never read. */
            const int64_t scale_offset = QUANTIZED ? row * s->num_kv_heads + h : 0;
            attend_block(&heads[h - h0], k_cache + offset + h * HEAD_DIM, v_cache + offset + h * HEAD_DIM,
                         QUANTIZED ? k_scales + scale_offset : NULL, QUANTIZED ? v_scales + scale_offset : NULL, n,
                         s->row_stride, s->num_kv_heads, s->softcap);
        }
    }
    const int64_t element = s->bf16_io ? 2 : 4;
    for (int64_t h = h0; h < h1; ++h)
        finish_head(&heads[h - h0], (char *)out + h * GROUP * HEAD_DIM * element, s->bf16_io);
}

void paged_decode_attention(const void *q, const kv_t *k_cache, const kv_t *v_cache, const float *k_scales,
                            const float *v_scales, const int32_t *block_tables, const int32_t *seq_lens, void *out,
                            int64_t batch, int64_t num_kv_heads, int64_t block_size, int64_t max_blocks, float scale,
                            int num_threads, int64_t window, float softcap, int bf16_io) {
    const int64_t row_stride = num_kv_heads * HEAD_DIM;
    const Shape s = {block_size, row_stride, block_size * row_stride, num_kv_heads, window, scale, softcap, bf16_io};
    const int64_t element = bf16_io ? 2 : 4;
    const int64_t heads_per_item = batch >= 2 * num_threads ? num_kv_heads : 1;
    const int64_t items_per_seq = num_kv_heads / heads_per_item;
    const int64_t seq_elements = num_kv_heads * GROUP * HEAD_DIM;
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
    for (int64_t w = 0; w < batch * items_per_seq; ++w) {
        const int64_t b = w / items_per_seq, h0 = (w % items_per_seq) * heads_per_item;
        attend(&s, (const char *)q + b * seq_elements * element, k_cache, v_cache, k_scales, v_scales,
               block_tables + b * max_blocks, seq_lens[b], h0, h0 + heads_per_item, (char *)out + b * seq_elements * element);
    }
}
