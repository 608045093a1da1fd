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
 * are scattered, and each thread's next sequence's first block while it reads its current one's last (items are
 * dealt round-robin). Batches too small to keep every thread busy are split by kv head instead. Softmax is online,
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
 * product, the softmax and the accumulator stay in float32 (AVX-512 BF16's dot-product instruction is not used for
 * V: it would round the probabilities to bf16 before they weight V; the gain is measured by
 * scripts/bench_cpu_dtypes.py, docs/benchmarks.md). With bf16 queries too (`bf16_io`) and AVX-512 BF16, the scores
 * are that instruction's dot products of the stored bits (pairs of exact products summed in float32, no widening),
 * 16 tokens at a time, then scaled: attention 8 % faster in a SmolLM2 decode step (scores_bf16). Or int8 / fp8
 * e4m3 with one float32 scale per token and kv head (kernels/kv_quant.py; scales [num_blocks, block_size, Hkv]).
 * A quantized element is widened exactly (int8 by conversion, e4m3 by moving its exponent and mantissa bits into a
 * float32's), and the scales never touch the D-wide rows: a key's scale multiplies its score, a value's scale the
 * probability that weighs it.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <omp.h>

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

/* bf16 queries over a bf16 cache: scores by AVX-512 BF16 dot products of the stored bits (pair products exact in
 * float32), 16 tokens at a time, the scale applied to the sums (see scores_bf16). */
#if KV_FORMAT == KV_BFLOAT16 && defined(__AVX512BF16__) && HEAD_DIM % 32 == 0
#include <immintrin.h>
#define BF16_SCORES 1
#else
#define BF16_SCORES 0
#endif

typedef struct {
    float q[GROUP][HEAD_DIM], acc[GROUP][HEAD_DIM], probs[GROUP][MAX_BLOCK_SIZE];
    float running_max[GROUP], denom[GROUP];
    uint16_t q_bits[GROUP][HEAD_DIM]; /* the bf16 queries as given, unscaled (BF16_SCORES with bf16_io) */
} HeadState;

static void prefetch(const void *start, int64_t bytes) {
    for (int64_t i = 0; i < bytes; i += 64) __builtin_prefetch((const char *)start + i);
}

#if BF16_SCORES
/* out[i] = the sum of v[i]'s 16 lanes, for 16 vectors: halves folded pairwise (16 -> 8 -> 4 -> 2 -> 1 lanes per
 * vector; 15 additions of whole vectors instead of a horizontal sum per score). The folds leave token 4i + j in
 * lane 4j + i, put back in order at the end. */
static inline __m512 sum_lanes16(__m512 v[16]) {
    __m512 a[8], b[4], c[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: v[2i]'s halves added, 8-15: v[2i+1]'s */
        a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* 128-bit block j: token 4i + j's four partial sums */
        b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* block j: tokens 8i + j and 8i + 4 + j, two partial sums each */
        c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
    /* lane 4j + i: token 4i + j */
    const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, d);
}

/* st->probs[g][t] = scale * q[g] . key t for n tokens: each pair of bf16 products exact in float32, summed in
 * float32 (the scalar path rounds q * scale to float32 first: the two differ by float32 rounding only). */
static inline void scores_bf16(HeadState *st, const kv_t *keys, int64_t n, int64_t row_stride, float scale) {
    for (int g = 0; g < GROUP; ++g) {
        __m512bh q[HEAD_DIM / 32];
        for (int c = 0; c < HEAD_DIM / 32; ++c)
            q[c] = (__m512bh)_mm512_loadu_si512(st->q_bits[g] + 32 * c);
        for (int64_t t0 = 0; t0 < n; t0 += 16) {
            const int m = n - t0 < 16 ? (int)(n - t0) : 16;
            __m512 part[16];
            for (int t = 0; t < 16; ++t) {
                part[t] = _mm512_setzero_ps();
                if (t < m) {
                    const kv_t *key = keys + (t0 + t) * row_stride;
                    for (int c = 0; c < HEAD_DIM / 32; ++c)
                        part[t] = _mm512_dpbf16_ps(part[t], q[c], (__m512bh)_mm512_loadu_si512(key + 32 * c));
                }
            }
            const __m512 sums = _mm512_mul_ps(sum_lanes16(part), _mm512_set1_ps(scale));
            _mm512_mask_storeu_ps(st->probs[g] + t0, (__mmask16)((1u << m) - 1), sums);
        }
    }
}
#endif

/* One kv head over n consecutive tokens of a block: scores, online softmax, then V into the registers'
 * accumulator. For a quantized cache, k_scales/v_scales point at the first token's scales (stride num_kv_heads);
 * otherwise they are unused. `bf16_scores`: the scores from st->q_bits times `scale` (scores_bf16; the other path's
 * queries carry the scale already). */
static inline void attend_block(HeadState *st, const kv_t *keys, const kv_t *values, const float *k_scales,
                                const float *v_scales, int64_t n, int64_t row_stride, int64_t scale_stride,
                                float softcap, int bf16_scores, float scale) {
#if BF16_SCORES
    if (bf16_scores)
        scores_bf16(st, keys, n, row_stride, scale);
    for (int64_t t = 0; t < n && !bf16_scores; ++t) {
#else
    (void)bf16_scores, (void)scale;
    for (int64_t t = 0; t < n; ++t) {
#endif
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

/* The first cache block a sequence's attention reads (its window's, with a sliding window), or -1 for none. */
static inline int64_t first_block(const Shape *s, const int32_t *blocks, int64_t seq_len) {
    if (seq_len <= 0)
        return -1;
    const int64_t first = s->window > 0 && seq_len > s->window ? seq_len - s->window : 0;
    return blocks[first / s->block_size];
}

/* Kv heads [h0, h1) of one sequence; q and out point at the sequence's first query head. `follow`: the block to
 * prefetch during the last one (the first block of this thread's next sequence), or -1. */
static void attend(const Shape *s, const void *q, const kv_t *k_cache, const kv_t *v_cache, const float *k_scales,
                   const float *v_scales, const int32_t *blocks, int64_t seq_len, int64_t h0, int64_t h1,
                   int64_t follow, void *out) {
    HeadState heads[MAX_KV_HEADS];
    for (int64_t h = h0; h < h1; ++h) {
        HeadState *st = &heads[h - h0];
        for (int g = 0; g < GROUP; ++g) {
            const int64_t first = (h * GROUP + g) * HEAD_DIM;
            for (int d = 0; d < HEAD_DIM; ++d)
                st->q[g][d] = (s->bf16_io ? bf16_to_float(((const uint16_t *)q)[first + d])
                                          : ((const float *)q)[first + d]) * s->scale;
            if (BF16_SCORES && s->bf16_io)
                memcpy(st->q_bits[g], (const uint16_t *)q + first, sizeof(st->q_bits[g]));
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
        const int64_t next = start + s->block_size < seq_len ? blocks[start / s->block_size + 1] : follow;
#if QUANTIZED
        if (next >= 0) {
            const int64_t scales = s->block_size * s->num_kv_heads;
            prefetch(k_scales + next * scales, scales * (int64_t)sizeof(float));
            prefetch(v_scales + next * scales, scales * (int64_t)sizeof(float));
        }
#endif
        for (int64_t h = h0; h < h1; ++h) {
            /* The next block's K and V fetched a slice before each head's pass over this one: issued all at once,
             * the prefetches stalled the thread until memory had sent most of them, and only then did it compute
             * (44 % of the kernel's time at 64 SmolLM2 sequences was spent issuing them). */
            if (next >= 0) {
                const int64_t bytes = s->block_stride * (int64_t)sizeof(kv_t), slice = bytes / (h1 - h0);
                const int64_t from = (h - h0) * slice, size = h + 1 == h1 ? bytes - from : slice;
                prefetch((const char *)(k_cache + next * s->block_stride) + from, size);
                prefetch((const char *)(v_cache + next * s->block_stride) + from, size);
            }
            /* At full precision the scale pointers are NULL and never read. */
            const int64_t scale_offset = QUANTIZED ? row * s->num_kv_heads + h : 0;
            attend_block(&heads[h - h0], k_cache + offset + h * HEAD_DIM, v_cache + offset + h * HEAD_DIM,
                         QUANTIZED ? k_scales + scale_offset : NULL, QUANTIZED ? v_scales + scale_offset : NULL, n,
                         s->row_stride, s->num_kv_heads, s->softcap, BF16_SCORES && s->bf16_io, s->scale);
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
    const int64_t items = batch * items_per_seq;
    /* Items dealt round-robin (static, 1), so each thread knows its next one and prefetches that sequence's first
     * block while it reads its current sequence's last: no sequence starts on a cold block (with dynamic items,
     * the attention of a SmolLM2 decode step took 8.1-8.3 ms at 64 sequences, 1.95-2.0 at 16; now 7.5-7.7 and
     * 1.8-1.85, docs/benchmarks.md). */
#pragma omp parallel num_threads(num_threads)
    {
        const int64_t team = omp_get_num_threads();
#pragma omp for schedule(static, 1)
        for (int64_t w = 0; w < items; ++w) {
            const int64_t b = w / items_per_seq, h0 = (w % items_per_seq) * heads_per_item;
            const int64_t after = w + team < items ? (w + team) / items_per_seq : -1;
            attend(&s, (const char *)q + b * seq_elements * element, k_cache, v_cache, k_scales, v_scales,
                   block_tables + b * max_blocks, seq_lens[b], h0, h0 + heads_per_item,
                   after >= 0 ? first_block(&s, block_tables + after * max_blocks, seq_lens[after]) : -1,
                   (char *)out + b * seq_elements * element);
        }
    }
}
