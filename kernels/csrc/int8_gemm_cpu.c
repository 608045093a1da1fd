/* int8 weight-only matrix products on CPUs without AMX: y [M, N] = x [M, K] @ (q [N, K] * s [N])^T, x float32 or
 * bf16, q int8 codes with a float32 scale per output channel (s), y in x's dtype.
 *
 * A decode step reads every weight once for a few rows of activations, so it is bound by reading them: int8 codes
 * are a quarter of float32's bytes. torch's fallback converts all codes to the activations' dtype in memory every
 * call (writing and reading the weight again at 2-4x its bytes); here the codes are widened to float32 in
 * registers as they are loaded, straight from the layout torch keeps ([N, K] row-major: no repacking, no copy).
 *
 * Portable: GCC's vector extensions, no intrinsics. Built with -march=native (kernels/native_build.py), a vector
 * is 8 floats on AVX2 (this project's Zen 3) and 16 on AVX-512 (Zen 4): the same source, tested on either.
 *
 * A register block is R rows x C channels of accumulators, each one vector of partial sums over the inputs
 * (lanes = inputs k, k + 1, ...): per step of one vector of inputs, C code vectors are widened once and reused by
 * the R rows, and each row's activations loaded once and reused by the C channels. Few rows (a decode step of
 * one sequence) leave few accumulators per channel, so the block takes more channels then (`block_channels`):
 * enough independent sums to cover the FMA's latency. Threads (OpenMP) take stripes of STRIPE channels as they
 * come free; within a stripe every row block of CHUNK_ROWS rows (their activations in L2) reuses the stripe's
 * codes (in L1/L2) before the next stripe is read.
 *
 * Batch invariance (kernels/cpu_gemm.py `linear`): each (row, channel) result is one chain of FMAs over the inputs
 * in order, one lane per input residue, its lanes summed in a fixed tree, whatever R and C the block has: a row's
 * result never depends on the other rows. This file is built without -ffast-math so that gcc keeps that order.
 *
 * Requirements (the caller checks): K % 16 == 0, N % 8 == 0, M >= 1, everything contiguous.
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

/* Rows m0 .. m0 + R - 1 times channels n0 .. n0 + C - 1 (R and C constants where inlined: the accumulators stay
 * in registers). */
static inline __attribute__((always_inline)) void block(const float *x, const int8_t *q, const float *s, void *out,
                                                        int act, int64_t m0, int64_t n0, int64_t N, int64_t K,
                                                        const int R, const int C) {
    vfloat acc[6][8]; /* R x C used (at most 6 rows, 8 channels) */
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = (vfloat){0};
    const float *xr = x + m0 * K;
    const int8_t *qc = q + n0 * K;
    for (int64_t k = 0; k < K; k += LANES) {
        vfloat w[8];
        for (int c = 0; c < C; c++)
            w[c] = widen_codes(qc + c * K + k);
        for (int r = 0; r < R; r++) {
            const vfloat a = load_floats(xr + r * K + k);
            for (int c = 0; c < C; c++)
                acc[r][c] += a * w[c];
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            store(out, (m0 + r) * N + n0 + c, lane_sum(acc[r][c]) * s[n0 + c], act);
}

/* Channels per block for R rows: 8 for one row, else the most (of 4 and 2) with R x C <= ACCUMULATORS. */
#define BLOCK_CHANNELS(R) ((R) == 1 ? 8 : (R) <= 3 ? 4 : 2)

/* Rows m0 .. m0 + R - 1 of one stripe of channels [n0, n1). */
static inline __attribute__((always_inline)) void stripe_rows(const float *x, const int8_t *q, const float *s,
                                                              void *out, int act, int64_t m0, int64_t n0, int64_t n1,
                                                              int64_t N, int64_t K, const int R) {
    for (int64_t n = n0; n < n1; n += BLOCK_CHANNELS(R))
        block(x, q, s, out, act, m0, n, N, K, R, BLOCK_CHANNELS(R));
}

/* Rows [m0, m1) of channels [n0, n1): blocks of 6 rows, the rest in one smaller block. */
static void stripe_product(const float *x, const int8_t *q, const float *s, void *out, int act, int64_t m0,
                           int64_t m1, int64_t n0, int64_t n1, int64_t N, int64_t K) {
    int64_t m = m0;
    for (; m + 6 <= m1; m += 6)
        stripe_rows(x, q, s, out, act, m, n0, n1, N, K, 6);
    switch (m1 - m) {
    case 5: stripe_rows(x, q, s, out, act, m, n0, n1, N, K, 5); break;
    case 4: stripe_rows(x, q, s, out, act, m, n0, n1, N, K, 4); break;
    case 3: stripe_rows(x, q, s, out, act, m, n0, n1, N, K, 3); break;
    case 2: stripe_rows(x, q, s, out, act, m, n0, n1, N, K, 2); break;
    case 1: stripe_rows(x, q, s, out, act, m, n0, n1, N, K, 1); break;
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

/* y = x @ (q * s)^T, x float32 (`act` 0) or bf16 (1), y in x's dtype. Returns 0 when done, -1 when these shapes
 * or this memory cannot (the caller then uses torch). */
int int8_weight_gemm(const void *x, const int8_t *q, const float *s, void *out, int64_t M, int64_t N, int64_t K,
                     int act, int num_threads) {
    if (M < 1 || N < 8 || K < 16 || N % 8 || K % 16 || (act != ACT_FLOAT32 && act != ACT_BF16) || LANES > 16)
        return -1;
    const float *xf = act == ACT_BF16 ? bf16_rows_to_float(x, M * K) : x;
    if (!xf)
        return -1;
    const int64_t stripes = (N + STRIPE - 1) / STRIPE;
    if (num_threads > stripes)
        num_threads = (int)stripes;
    if (num_threads < 1)
        num_threads = 1;
#pragma omp parallel num_threads(num_threads)
    for (int64_t m0 = 0; m0 < M; m0 += CHUNK_ROWS) {
        const int64_t m1 = M - m0 < CHUNK_ROWS ? M : m0 + CHUNK_ROWS;
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < stripes; t++) {
            const int64_t n0 = t * STRIPE, n1 = N - n0 < STRIPE ? N : n0 + STRIPE;
            stripe_product(xf, q, s, out, act, m0, m1, n0, n1, N, K);
        }
    }
    return 0;
}
