/* Weight-only matrix products on CPUs without AMX: y [M, N] = x [M, K] @ w [N, K]^T, x float32 or bf16, y in x's
 * dtype, w held as
 *   - int8 codes q [N, K] with a float32 scale per output channel: w = q * s (`int8_weight_gemm`);
 *   - AWQ's 4-bit codes with a scale and zero point per output channel and group of G inputs: w = (c - z) * s,
 *     held as (s, -z * s) pairs, so that one FMA widens a code (`int4_weight_gemm`, layout below).
 *
 * A decode step reads every weight once for a few rows of activations, so it is bound by reading them: int8 codes
 * are a quarter of float32's bytes, int4 an eighth. torch's fallbacks convert all codes to the activations' dtype
 * in memory every call (writing and reading the weight again at 2-4x its bytes), or, for int4 with float32
 * activations on an AVX2 CPU (`_weight_int4pack_mm_for_cpu`), run 9-55x slower than float32's matmul; here the
 * codes are widened to float32 in registers as they are loaded.
 *
 * Portable: GCC's vector extensions, no intrinsics but for the codes' widening. Built with -march=native
 * (kernels/native_build.py), a vector is 8 floats on AVX2 (Zen 3) and 16 on AVX-512 (Zen 4): the same source,
 * tested on either.
 *
 * A register block is R rows x C channels of accumulators, each one vector of partial sums over the inputs
 * (lanes = inputs k, k + 1, ...): per step of one vector of inputs, C code vectors are widened once and reused by
 * the R rows, and each row's activations loaded once and reused by the C channels. Few rows (a decode step of
 * one sequence) leave few accumulators per channel, so the block takes more channels then (`BLOCK_CHANNELS`):
 * enough independent sums to cover the FMA's latency. Threads (OpenMP) take stripes of STRIPE channels as they
 * come free; within a stripe every row block of CHUNK_ROWS rows (their activations in L2) reuses the stripe's
 * codes (in L1/L2) before the next stripe is read.
 *
 * The int4 layout (kernels/cpu_gemm_portable.py `repack_int4`): codes uint8 [N, K / 2], each channel's inputs in
 * chunks of 2 * LANES (`int4_chunk()`), a chunk's LANES bytes holding input k + i in the low nibble of byte i and
 * input k + LANES + i in the high one: one load, a mask and a shift give two vectors of consecutive inputs.
 * Pairs float32 [N, K / G, 2]: per channel and group, s and -z * s.
 *
 * Batch invariance (kernels/cpu_gemm.py `linear`): each (row, channel) result is one chain of FMAs over the inputs
 * in order, one lane per input residue, its lanes summed in a fixed tree, whatever R and C the block has: a row's
 * result never depends on the other rows. This file is built without -ffast-math so that gcc keeps that order.
 *
 * Requirements (the caller checks): int8: K % 16 == 0, N % 8 == 0; int4: G % int4_chunk() == 0, K % G == 0,
 * N % 8 == 0; M >= 1, everything contiguous.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#ifndef LANES
#if defined(__AVX512F__)
#define LANES 16
#else
#define LANES 8
#endif
#endif

#define STRIPE 64      /* channels a thread takes at a time (a multiple of every block's channels) */
#define CHUNK_ROWS 64  /* rows whose activations one pass over a stripe's codes serves */
#define ACCUMULATORS 12 /* register block size R x C: 12 of 16 AVX2 registers (the rest: codes and activations) */

#define ACT_FLOAT32 0
#define ACT_BF16 1

typedef float vfloat __attribute__((vector_size(LANES * 4)));
typedef int32_t vint __attribute__((vector_size(LANES * 4)));

static inline vfloat load_floats(const float *p) {
    vfloat v;
    memcpy(&v, p, sizeof v);
    return v;
}

/* LANES codes as floats (exact). gcc 12 turns __builtin_convertvector of int8 lanes into scalar code, so the
 * sign extension is an intrinsic where there is one. */
static inline vfloat widen_codes(const int8_t *p) {
#if LANES == 16 && defined(__AVX512F__)
    return (vfloat)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#elif LANES == 8 && defined(__AVX2__)
    return (vfloat)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    vint c;
    for (int i = 0; i < LANES; i++)
        c[i] = p[i];
    return __builtin_convertvector(c, vfloat);
#endif
}

/* 2 * LANES int4 codes (the layout above) as two vectors of floats: inputs k .. k + LANES - 1, then the next LANES. */
static inline void widen_nibbles(const uint8_t *p, vfloat *low, vfloat *high) {
#if LANES == 16 && defined(__AVX512F__)
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)p));
    *low = (vfloat)_mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)));
    *high = (vfloat)_mm512_cvtepi32_ps(_mm512_srli_epi32(b, 4));
#elif LANES == 8 && defined(__AVX2__)
    const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)p));
    *low = (vfloat)_mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(15)));
    *high = (vfloat)_mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
#else
    vint lo, hi;
    for (int i = 0; i < LANES; i++) {
        lo[i] = p[i] & 15;
        hi[i] = p[i] >> 4;
    }
    *low = __builtin_convertvector(lo, vfloat);
    *high = __builtin_convertvector(hi, vfloat);
#endif
}

int int4_chunk(void) { return 2 * LANES; }

/* The lanes' sum in a fixed order (halves added pairwise). */
static inline float lane_sum(vfloat v) {
    float t[LANES];
    memcpy(t, &v, sizeof t);
    for (int width = LANES / 2; width >= 1; width /= 2)
        for (int i = 0; i < width; i++)
            t[i] += t[i + width];
    return t[0];
}

static inline uint16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);        /* to nearest, ties to even */
    return (uint16_t)(bits >> 16);
}

static inline void store(void *out, int64_t index, float value, int act) {
    if (act == ACT_BF16)
        ((uint16_t *)out)[index] = to_bf16(value);
    else
        ((float *)out)[index] = value;
}

/* The weights of one call: int8 codes and channel scales, or int4 codes and (scale, bias) pairs per group. */
typedef struct {
    const int8_t *q;
    const float *s;
    const uint8_t *c4;
    const float *pairs;
    int64_t group;
} Weights;

/* One vector of a weight row: int8 codes widened, or floats (int4 codes widened already, `widen_channels`). */
static inline __attribute__((always_inline)) vfloat weight_vector(const void *w, int64_t index, const int FLOATS) {
    return FLOATS ? load_floats((const float *)w + index) : widen_codes((const int8_t *)w + index);
}

/* Rows m0 .. m0 + R - 1 times C channels whose weight rows [C, K] start at `w` (R and C constants where inlined:
 * the accumulators stay in registers); each result times s[c] where there are scales (int8). */
static inline __attribute__((always_inline)) void block(const float *x, const void *w, const float *s, void *out,
                                                        int act, int64_t m0, int64_t n0, int64_t N, int64_t K,
                                                        const int R, const int C, const int FLOATS) {
    vfloat acc[6][8]; /* R x C used (at most 6 rows, 8 channels) */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = (vfloat){0};
    const float *xr = x + m0 * K;
    for (int64_t k = 0; k < K; k += LANES) {
        vfloat wide[8];
        for (int c = 0; c < C; c++)
            wide[c] = weight_vector(w, c * K + k, FLOATS);
        for (int r = 0; r < R; r++) {
            const vfloat a = load_floats(xr + r * K + k);
            for (int c = 0; c < C; c++)
                acc[r][c] += a * wide[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            store(out, (m0 + r) * N + n0 + c, s ? lane_sum(acc[r][c]) * s[c] : lane_sum(acc[r][c]), act);
}

/* int4: the same block, each group's codes widened as code * s + (-z * s) (one FMA) before their products. */
static inline __attribute__((always_inline)) void block4(const float *x, const Weights *w, void *out, int act,
                                                         int64_t m0, int64_t n0, int64_t N, int64_t K, const int R,
                                                         const int C) {
    vfloat acc[6][2]; /* R x C used (at most 4 rows, 2 channels; 6 rows compiled, never called) */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = (vfloat){0};
    const float *xr = x + m0 * K;
    const int64_t G = w->group, groups = K / G;
    for (int64_t g = 0; g < groups; g++) {
        vfloat scale[2], bias[2];
        for (int c = 0; c < C; c++) {
            const float *pair = w->pairs + ((n0 + c) * groups + g) * 2;
            scale[c] = (vfloat){0} + pair[0];
            bias[c] = (vfloat){0} + pair[1];
        }
        for (int64_t k = g * G; k < (g + 1) * G; k += 2 * LANES) {
            vfloat low[2], high[2];
            for (int c = 0; c < C; c++) {
                widen_nibbles(w->c4 + (n0 + c) * (K / 2) + k / 2, &low[c], &high[c]);
                low[c] = low[c] * scale[c] + bias[c];
                high[c] = high[c] * scale[c] + bias[c];
            }
            for (int r = 0; r < R; r++) {
                const vfloat a = load_floats(xr + r * K + k), b = load_floats(xr + r * K + k + LANES);
                for (int c = 0; c < C; c++) {
                    acc[r][c] += a * low[c];
                    acc[r][c] += b * high[c];
                }
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            store(out, (m0 + r) * N + n0 + c, lane_sum(acc[r][c]), act);
}

/* int4 for more rows than one block: the codes of C channels widened once (by block4's arithmetic, so to the same
 * numbers) into `wide` [C, K] float32, which stays in L1 while `block` multiplies every block of rows by it, in
 * block4's order (the same sums whatever the rows around them). */
static void widen_channels(const Weights *w, float *wide, int64_t n0, int64_t K, const int C) {
    const int64_t G = w->group, groups = K / G;
    for (int c = 0; c < C; c++)
        for (int64_t g = 0; g < groups; g++) {
            const float *pair = w->pairs + ((n0 + c) * groups + g) * 2;
            const vfloat scale = (vfloat){0} + pair[0], bias = (vfloat){0} + pair[1];
            for (int64_t k = g * G; k < (g + 1) * G; k += 2 * LANES) {
                vfloat low, high;
                widen_nibbles(w->c4 + (n0 + c) * (K / 2) + k / 2, &low, &high);
                low = low * scale + bias;
                high = high * scale + bias;
                memcpy(wide + c * K + k, &low, sizeof low);
                memcpy(wide + c * K + k + LANES, &high, sizeof high);
            }
        }
}

/* Channels per block for R rows: int8 8 for one row, else the most (of 4 and 2) with R x C <= ACCUMULATORS; int4,
 * whose widened codes and group pairs take four registers per channel, 2 (with 4 at one row gcc spilled the
 * accumulators: 8.4-8.9 -> 9.6-9.8 G weights/s at one row, one thread, AVX2). Rows per block: 6 / 4. */
#define BLOCK_CHANNELS(R, BITS) ((BITS) == 8 ? ((R) == 1 ? 8 : (R) <= 3 ? 4 : 2) : 2)
#define BLOCK_ROWS(BITS) ((BITS) == 8 ? 6 : 4)

/* Rows m0 .. m0 + R - 1 of one stripe of channels [n0, n1). */
static inline __attribute__((always_inline)) void stripe_rows(const float *x, const Weights *w, void *out, int act,
                                                              int64_t m0, int64_t n0, int64_t n1, int64_t N,
                                                              int64_t K, const int R, const int BITS) {
    for (int64_t n = n0; n < n1; n += BLOCK_CHANNELS(R, BITS)) {
        if (BITS == 8)
            block(x, w->q + n * K, w->s + n, out, act, m0, n, N, K, R, BLOCK_CHANNELS(R, BITS), 0);
        else
            block4(x, w, out, act, m0, n, N, K, R, BLOCK_CHANNELS(R, BITS));
    }
}

static __thread float *wide_w;
static __thread size_t wide_w_capacity;

/* int4, rows [m0, m1) of channels [n0, n1) when they are more than one block: each pair of channels widened once
 * into this thread's scratch, then blocks of 6 rows (the rest in one smaller block). 0, or -1 out of memory. */
static int stripe_wide(const float *x, const Weights *w, void *out, int act, int64_t m0, int64_t m1, int64_t n0,
                       int64_t n1, int64_t N, int64_t K) {
    const size_t bytes = (size_t)(2 * K) * sizeof(float);
    if (bytes > wide_w_capacity) {
        free(wide_w);
        wide_w = aligned_alloc(64, (bytes + 63) / 64 * 64);
        wide_w_capacity = wide_w ? bytes : 0;
    }
    if (!wide_w)
        return -1;
    for (int64_t n = n0; n < n1; n += 2) {
        widen_channels(w, wide_w, n, K, 2);
        int64_t m = m0;
        for (; m + 6 <= m1; m += 6)
            block(x, wide_w, NULL, out, act, m, n, N, K, 6, 2, 1);
        switch (m1 - m) {
        case 5: block(x, wide_w, NULL, out, act, m, n, N, K, 5, 2, 1); break;
        case 4: block(x, wide_w, NULL, out, act, m, n, N, K, 4, 2, 1); break;
        case 3: block(x, wide_w, NULL, out, act, m, n, N, K, 3, 2, 1); break;
        case 2: block(x, wide_w, NULL, out, act, m, n, N, K, 2, 2, 1); break;
        case 1: block(x, wide_w, NULL, out, act, m, n, N, K, 1, 2, 1); break;
        default: break;
        }
    }
    return 0;
}

/* Rows [m0, m1) of channels [n0, n1): blocks of BLOCK_ROWS rows, the rest in one smaller block. */
static inline __attribute__((always_inline)) void stripe_product(const float *x, const Weights *w, void *out, int act,
                                                                 int64_t m0, int64_t m1, int64_t n0, int64_t n1,
                                                                 int64_t N, int64_t K, const int BITS) {
    int64_t m = m0;
    for (; m + BLOCK_ROWS(BITS) <= m1; m += BLOCK_ROWS(BITS))
        stripe_rows(x, w, out, act, m, n0, n1, N, K, BLOCK_ROWS(BITS), BITS);
    switch (m1 - m) {
    case 5: stripe_rows(x, w, out, act, m, n0, n1, N, K, 5, BITS); break;
    case 4: stripe_rows(x, w, out, act, m, n0, n1, N, K, 4, BITS); break;
    case 3: stripe_rows(x, w, out, act, m, n0, n1, N, K, 3, BITS); break;
    case 2: stripe_rows(x, w, out, act, m, n0, n1, N, K, 2, BITS); break;
    case 1: stripe_rows(x, w, out, act, m, n0, n1, N, K, 1, BITS); break;
    default: break;
    }
}

static __thread float *wide_x;
static __thread size_t wide_x_capacity;

/* bf16 activations as float32 (exact) in this thread's buffer, kept between calls; NULL when out of memory. */
static const float *bf16_rows_to_float(const uint16_t *x, int64_t count) {
    const size_t bytes = (size_t)count * sizeof(float);
    if (bytes > wide_x_capacity) {
        free(wide_x);
        wide_x = aligned_alloc(64, (bytes + 63) / 64 * 64);
        wide_x_capacity = wide_x ? bytes : 0;
    }
    if (!wide_x)
        return NULL;
    for (int64_t i = 0; i < count; i++) {
        const uint32_t bits = (uint32_t)x[i] << 16;
        memcpy(wide_x + i, &bits, sizeof bits);
    }
    return wide_x;
}

/* Both products: threads over stripes of channels, for each chunk of CHUNK_ROWS rows. -1 when the activations
 * cannot be widened (out of memory). */
static inline __attribute__((always_inline)) int product(const void *x, const Weights *w, void *out, int64_t M,
                                                         int64_t N, int64_t K, int act, int num_threads,
                                                         const int BITS) {
    const float *xf = act == ACT_BF16 ? bf16_rows_to_float(x, M * K) : x;
    if (!xf)
        return -1;
    const int64_t stripes = (N + STRIPE - 1) / STRIPE;
    if (num_threads > stripes)
        num_threads = (int)stripes;
    if (num_threads < 1)
        num_threads = 1;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
        const int64_t m1 = M - m0 < CHUNK_ROWS ? M : m0 + CHUNK_ROWS;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < stripes; t++) {
            const int64_t n0 = t * STRIPE, n1 = N - n0 < STRIPE ? N : n0 + STRIPE;
            if (BITS == 4 && m1 - m0 > BLOCK_ROWS(4))
                failed |= stripe_wide(xf, w, out, act, m0, m1, n0, n1, N, K) != 0;
            else
                stripe_product(xf, w, out, act, m0, m1, n0, n1, N, K, BITS);
        }
    }
    return failed ? -1 : 0;
}

/* y = x @ (q * s)^T, x float32 (`act` 0) or bf16 (1), y in x's dtype. Returns 0 when done, -1 when these shapes
 * or this memory cannot (the caller then uses torch). */
int int8_weight_gemm(const void *x, const int8_t *q, const float *s, void *out, int64_t M, int64_t N, int64_t K,
                     int act, int num_threads) {
    if (M < 1 || N < 8 || K < 16 || N % 8 || K % 16 || (act != ACT_FLOAT32 && act != ACT_BF16) || LANES > 16)
        return -1;
    const Weights w = {q, s, NULL, NULL, 0};
    return product(x, &w, out, M, N, K, act, num_threads, 8);
}

/* Whether N channels of K inputs in groups of `group` have the int4 layout's shape in this build. */
static int int4_shape(int64_t N, int64_t K, int64_t group) {
    return N >= 8 && N % 8 == 0 && group >= 2 * LANES && group % (2 * LANES) == 0 && K >= group && K % group == 0;
}

/* y = x @ w^T for AWQ int4 codes in the layout above, w = code * pair[0] + pair[1] per channel and group of
 * `group` inputs; x float32 or bf16, y in x's dtype. 0 when done, -1 when these shapes or this memory cannot. */
int int4_weight_gemm(const void *x, const uint8_t *codes, const float *pairs, void *out, int64_t M, int64_t N,
                     int64_t K, int64_t group, int act, int num_threads) {
    if (M < 1 || !int4_shape(N, K, group) || (act != ACT_FLOAT32 && act != ACT_BF16))
        return -1;
    const Weights w = {NULL, NULL, codes, pairs, group};
    return product(x, &w, out, M, N, K, act, num_threads, 4);
}

/* The float32 weight [N, K] that `int4_weight_gemm` multiplies by, for torch's matmul where that is faster
 * (prefill's many rows). 0 when done, -1 when these shapes cannot. */
int int4_widen(const uint8_t *codes, const float *pairs, float *out, int64_t N, int64_t K, int64_t group,
               int num_threads) {
    if (!int4_shape(N, K, group))
        return -1;
    const Weights w = {NULL, NULL, codes, pairs, group};
#pragma omp parallel for num_threads(num_threads < 1 ? 1 : num_threads) schedule(static)
    for (int64_t n = 0; n < N; n++)
        widen_channels(&w, out + n * K, n, K, 1);
    return 0;
}
