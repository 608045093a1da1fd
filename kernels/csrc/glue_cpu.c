/* The element-wise "glue" of a decoder layer on CPU, one pass over the rows per call instead of torch's chain of
 * small ops (each its own dispatch, its own pass over memory and its own temporary):
 *
 *   add_rms_norm  sum = x + delta (when delta is given), then out = sum / rms(sum) * (offset + weight)
 *   rotary        q and k rotated in place by their token's cos/sin (the NeoX halves layout, maybe partial)
 *   silu_mul      out = silu(gate) * up, from the fused gate/up projection's rows
 *   write_kv      a step's new keys and values copied into their cache slots (torch's index_copy_ twice, each
 *                 with its dispatch, cost more than the copy of a decode step's few rows)
 *
 * Each element type is its own build (-DELEMENT: 0 float32, 1 bfloat16). bf16 elements are widened to float32 as
 * they are read (a shift) and rounded to nearest even once when written: the arithmetic between stays in float32
 * (torch's own bf16 rms_norm does the same; its chains of bf16 ops round after every op, so a bf16 result here is
 * the same value or within one rounding of it). A bf16 residual is rounded before it is normed, as torch's add
 * then norm does. Rows go to OpenMP threads when there is enough work to pay for waking them.
 * -ffast-math vectorizes the sums and expf (libmvec); the one reciprocal square root per row is taken in double.
 * bf16 builds on AVX-512 BF16 run the element-wise passes in whole vectors (below).
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define ELEMENT_FLOAT32 0
#define ELEMENT_BFLOAT16 1
#ifndef ELEMENT
#define ELEMENT ELEMENT_FLOAT32
#endif

/* Below this many elements (a decode step's sizes: 64 rows of a 1,536-wide MLP are 98,304) a call runs on the
 * calling thread: a pass over them takes tens of microseconds, and waking the pool costs more than it saves, far
 * more on a loaded machine, where the caller waits at the barrier for a thread that is not running (measured with
 * the pool woken from 65,536: scripts/bench_glue.py's 64 rows of float32 glue took 6.9 ms of CPU with 2 threads,
 * 0.6 ms with 1, on a machine loaded 12 on 2 cores). */
#define PARALLEL_ELEMENTS 262144
/* silu_mul's: an exponential per element makes it ~10x the work of the other glue per element (16 rows of a
 * 1,536-wide MLP: 20 us on one thread, while the other waited for the down projection). */
#define SILU_PARALLEL_ELEMENTS 16384

#if ELEMENT == ELEMENT_BFLOAT16
typedef uint16_t elem_t;
typedef union {
    uint32_t bits;
    float value;
} f32_bits;
static inline float load(const elem_t *p, int64_t i) {
    const f32_bits x = {(uint32_t)p[i] << 16};
    return x.value;
}
static inline void store(elem_t *p, int64_t i, float v) {
    const f32_bits x = {.value = v};
    /* Round to nearest even; a NaN keeps its sign and stays a (quiet) NaN. Integer tests: -ffast-math may drop
     * a float NaN test. */
    const uint32_t nan = (x.bits & 0x7FFFFFFFu) > 0x7F800000u;
    const uint32_t rounded = (x.bits + 0x7FFFu + ((x.bits >> 16) & 1u)) >> 16;
    p[i] = (elem_t)(nan ? (x.bits >> 16) | 0x40u : rounded);
}
#else
typedef float elem_t;
static inline float load(const elem_t *p, int64_t i) { return p[i]; }
static inline void store(elem_t *p, int64_t i, float v) { p[i] = v; }
#endif

/* The element-wise passes of bf16 rows 16 elements at a time on AVX-512 BF16: gcc vectorizes the scalar loops
 * below only in part (half-width vectors, a scalar bf16 store per element). 64 rows of SmolLM2, one thread, hot
 * caches: the add + norm 19.2 -> 9.8 us, rotary 13.9 -> 4.9 us, silu_mul 69.7 -> 35.2 us (its exponential
 * bf16_vectors.h's exp16: 10 of 393,216 results off the correctly rounded bf16, libmvec's expf 7). VCVTNEPS2BF16
 * rounds to nearest even and quiets a NaN as `store` does; it also flushes subnormal results to zero. */
#if ELEMENT == ELEMENT_BFLOAT16 && defined(__AVX512BF16__)
#include "bf16_vectors.h"
#define VECTOR_BF16 1
#else
#define VECTOR_BF16 0
#endif

/* 1 / rms of a row from its sum of squares (the one reciprocal square root, in double). */
static inline float inverse_rms(float squares, int64_t width, float eps) {
    return (float)(1.0 / sqrt((double)squares / (double)width + (double)eps));
}

/* y = row * inv_rms * (offset + weight), rounded once: the row in the elements' dtype (`row`) or, where `wide` is
 * not NULL, in float32 (a 16-bit model's residual stream). */
static inline void scaled_row(elem_t *y, const elem_t *row, const float *wide, const elem_t *weight, int64_t width,
                              float inv_rms, float offset) {
    int64_t i = 0;
#if VECTOR_BF16
    const __m512 scale = _mm512_set1_ps(inv_rms), shift = _mm512_set1_ps(offset);
    for (; i + 16 <= width; i += 16) {
        const __m512 v = wide ? _mm512_loadu_ps(wide + i) : bf16x16_to_float(row + i);
        const __m512 w = _mm512_add_ps(shift, bf16x16_to_float(weight + i));
        float_to_bf16x16(y + i, _mm512_mul_ps(_mm512_mul_ps(v, scale), w));
    }
#endif
    for (; i < width; i++)
        store(y, i, (wide ? wide[i] : load(row, i)) * inv_rms * (offset + load(weight, i)));
}

/* One row of add_rms_norm: `row` (x's), `d` (delta's) or NULL, `s` where the sum goes, `y` where the norm goes.
 * The sum of squares is the compiler's loop. */
static inline void norm_row(const elem_t *row, const elem_t *d, elem_t *s, const elem_t *weight, elem_t *y,
                            int64_t width, float eps, float offset) {
    if (d != NULL) {
        int64_t i = 0;
#if VECTOR_BF16
        for (; i + 16 <= width; i += 16)
            float_to_bf16x16(s + i, _mm512_add_ps(bf16x16_to_float(row + i), bf16x16_to_float(d + i)));
#endif
        for (; i < width; i++)
            store(s, i, load(row, i) + load(d, i));
        row = s;
    }
    float squares = 0.0f;
    for (int64_t i = 0; i < width; i++) {
        const float v = load(row, i);
        squares += v * v;
    }
    scaled_row(y, row, NULL, weight, width, inverse_rms(squares, width, eps), offset);
}

/* x [rows, width] (rows x_stride elements apart), delta [rows, width] (delta_stride apart) or NULL, weight
 * [width]; out [rows, width] and, with delta, sum [rows, width] (x + delta, the new residual) contiguous. */
void add_rms_norm(const elem_t *x, int64_t x_stride, const elem_t *delta, int64_t delta_stride, const elem_t *weight,
                  elem_t *out, elem_t *sum, int64_t rows, int64_t width, float eps, float offset, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        norm_row(x + r * x_stride, delta != NULL ? delta + r * delta_stride : NULL, sum + r * width, weight,
                 out + r * width, width, eps, offset);
}

/* add_rms_norm of a 16-bit model whose residual stream is float32 (worker_node/models/layers.py's RMSNorm.add):
 * x [rows, width] float32 (x_stride apart), delta (delta_stride apart) or NULL and weight in the model's dtype;
 * sum = x + delta in float32, unrounded (with delta); out = norm(sum) rounded once. Rounding the residual to bf16
 * after every add, as HF's bf16 models do, is the largest error of a bf16 forward: on SmolLM2 it put a
 * teacher-forced logprob 0.30 from float32's (0.09 kept in float32; docs/benchmarks.md). */
void add_rms_norm_f32(const float *x, int64_t x_stride, const elem_t *delta, int64_t delta_stride,
                      const elem_t *weight, elem_t *out, float *sum, int64_t rows, int64_t width, float eps,
                      float offset, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float *row = x + r * x_stride;
        if (delta != NULL) {
            const elem_t *d = delta + r * delta_stride;
            float *s = sum + r * width;
            for (int64_t i = 0; i < width; i++)
                s[i] = row[i] + load(d, i);
            row = s;
        }
        float squares = 0.0f;
        for (int64_t i = 0; i < width; i++)
            squares += row[i] * row[i];
        scaled_row(out + r * width, NULL, row, weight, width, inverse_rms(squares, width, eps), offset);
    }
}

/* One head's first `rot` dims rotated: the pairs (i, i + rot/2) by the angle whose cos/sin are c[i], s[i]. */
static inline void rotate_head(elem_t *x, const elem_t *c, const elem_t *s, int64_t half) {
    int64_t i = 0;
#if VECTOR_BF16
    for (; i + 16 <= half; i += 16) {
        const __m512 a = bf16x16_to_float(x + i), b = bf16x16_to_float(x + i + half);
        const __m512 cos_i = bf16x16_to_float(c + i), sin_i = bf16x16_to_float(s + i);
        float_to_bf16x16(x + i, _mm512_sub_ps(_mm512_mul_ps(a, cos_i), _mm512_mul_ps(b, sin_i)));
        float_to_bf16x16(x + i + half, _mm512_add_ps(_mm512_mul_ps(b, cos_i), _mm512_mul_ps(a, sin_i)));
    }
#endif
    for (; i < half; i++) {
        const float a = load(x, i), b = load(x, i + half), cos_i = load(c, i), sin_i = load(s, i);
        store(x, i, a * cos_i - b * sin_i);
        store(x, i + half, b * cos_i + a * sin_i);
    }
}

/* q [tokens, q_heads, head_dim] and k [tokens, k_heads, head_dim], heads contiguous inside a token, tokens
 * q_stride / k_stride elements apart (views into the fused QKV projection's rows); cos / sin [tokens, rot]
 * contiguous (only their first rot/2 columns are read: the second half repeats them). */
void rotary(elem_t *q, int64_t q_stride, int64_t q_heads, elem_t *k, int64_t k_stride, int64_t k_heads,
            const elem_t *cos, const elem_t *sin, int64_t tokens, int64_t head_dim, int64_t rot, int threads) {
    const int64_t half = rot / 2;
#pragma omp parallel for num_threads(threads) if (tokens * (q_heads + k_heads) * rot >= PARALLEL_ELEMENTS)          \
    schedule(static)
    for (int64_t t = 0; t < tokens; t++) {
        const elem_t *c = cos + t * rot, *s = sin + t * rot;
        for (int64_t h = 0; h < q_heads; h++)
            rotate_head(q + t * q_stride + h * head_dim, c, s, half);
        for (int64_t h = 0; h < k_heads; h++)
            rotate_head(k + t * k_stride + h * head_dim, c, s, half);
    }
}

/* gate_up [rows, 2 * width] contiguous (gate then up), out [rows, width] contiguous. */
void silu_mul(const elem_t *gate_up, elem_t *out, int64_t rows, int64_t width, int threads) {
#pragma omp parallel for num_threads(threads) if (rows * width >= SILU_PARALLEL_ELEMENTS) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const elem_t *gate = gate_up + r * 2 * width, *up = gate + width;
        elem_t *y = out + r * width;
        int64_t i = 0;
#if VECTOR_BF16
        for (; i + 16 <= width; i += 16)
            float_to_bf16x16(y + i, silu_mul16(bf16x16_to_float(gate + i), bf16x16_to_float(up + i)));
#endif
        for (; i < width; i++) {
            const float g = load(gate, i);
            store(y, i, g / (1.0f + expf(-g)) * load(up, i));
        }
    }
}

/* Rows [rows, width] of k and v (rows k_stride / v_stride elements apart: views of the fused QKV projection's
 * output) copied to rows slots[t] of k_cache and v_cache ([num_slots, width] contiguous). Returns 0, or -1 with
 * nothing written when a slot is out of range. */
int write_kv(const elem_t *k, int64_t k_stride, const elem_t *v, int64_t v_stride, elem_t *k_cache, elem_t *v_cache,
             const int64_t *slots, int64_t rows, int64_t width, int64_t num_slots) {
    for (int64_t t = 0; t < rows; t++)
        if (slots[t] < 0 || slots[t] >= num_slots)
            return -1;
    for (int64_t t = 0; t < rows; t++) {
        memcpy(k_cache + slots[t] * width, k + t * k_stride, (size_t)width * sizeof(elem_t));
        memcpy(v_cache + slots[t] * width, v + t * v_stride, (size_t)width * sizeof(elem_t));
    }
    return 0;
}
