/* Decode-sized matrix products on x86 CPUs without AMX: y [M, N] = x [M, K] @ w [N, K]^T for bf16 activations,
 * w bf16 or int8 codes with a float32 scale per output channel (w = q * s), y bf16 or float32. The entries and
 * their signature are skinny_gemm_cpu.c's (`skinny_gemm`, `skinny_gemm_f32`), so kernels/cpu_gemm.py and the
 * decode runner (decode_layers_cpu.c) call this library where the AMX one does not run. A third format, fp8
 * (e4m3) codes with a scale per channel, is this kernel's only (fp8 weights on CPU: kernels/cpu_gemm.py).
 *
 * A decode step of one sequence reads every weight once for one row of activations: it is bound by memory, and
 * what matters is to stream the weights at the memory's speed with both cores, widening them in registers (torch's
 * bf16 matmul on an AVX2 CPU converts, or walks the weight once per row). One source, two builds chosen by the
 * CPU's flags (kernels/cpu_isa.py), each with its own -m flags (not -march=native: an AMX machine tests both):
 *   - AVX-512 BF16 (Zen 4, Cooper Lake; `__AVX512BF16__`): VDPBF16PS, 32 bf16 products of a weight row's and an
 *     activation row's consecutive inputs into 16 float32 lanes; int8 codes widened to bf16 first (exact:
 *     |q| <= 127 fits bf16's 8 bits; an e4m3 code's 3 mantissa bits too);
 *   - AVX2 + FMA (Zen 3, Haswell and later): bf16 widened to float32 by a shift or a mask (exact), 8 lanes, FMA;
 *     the activations widened once per call.
 *
 * A register block is R rows x C channels of accumulators, each one vector of partial sums along the inputs: per
 * step, C weight vectors are loaded (widened) once and used by R rows. Fewer rows take more channels (enough
 * independent sums to cover the FMA's latency). Threads take stripes of 32 channels (stripes.h: a contiguous run
 * each, the next one prefetched into L2 while one multiplies); within a stripe each group of 8 channels serves
 * every row block while its weights are in L1.
 *
 * Batch-invariant: each (row, channel) result is one chain over the inputs in order, its lanes summed in a fixed
 * tree, whatever the rows around it. Built without -ffast-math (gcc keeps that order).
 *
 * Requirements (kernels/cpu_gemm.py checks them): K % 32 == 0, N % 16 == 0, 1 <= M; everything contiguous.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "stripes.h"

typedef uint16_t bf16_t;

#define FORMAT_BF16 0
#define FORMAT_INT8 1
#define FORMAT_FP8 2 /* e4m3: sign, 4 exponent bits (bias 7), 3 mantissa bits; no infinities */
#define STRIPE 32 /* channels per stripe */
#define GROUP 8   /* channels whose weights stay in L1 while every row block multiplies them */
#define ROWS 6    /* rows per block (6 x 2 accumulators: 12 of AVX2's 16 registers) */

#if defined(__AVX512BF16__)
#define KSTEP 32 /* inputs per step */
typedef __m512 acc_t;
typedef __m512bh operand_t;

static inline acc_t acc_zero(void) { return _mm512_setzero_ps(); }

/* 16 e4m3 codes (one a 32-bit lane) as float32, exactly: `fp8_to_float8`'s arithmetic. */
static inline __m512 fp8_to_float16(__m512i b) {
    const __m512i magnitude = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7f)), 20);
    const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
    const __m512 value = _mm512_mul_ps(_mm512_castsi512_ps(magnitude), _mm512_set1_ps(0x1p120f));
    return _mm512_or_ps(value, _mm512_castsi512_ps(sign));
}

/* 32 weights of one channel from index i, as bf16 pairs. */
static inline __attribute__((always_inline)) operand_t weights(const void *w, int64_t i, const int FORMAT) {
    if (FORMAT == FORMAT_BF16)
        return (operand_t)_mm512_loadu_si512((const bf16_t *)w + i);
    const __m256i q = _mm256_loadu_si256((const __m256i *)((const int8_t *)w + i));
    __m512 lo, hi;
    if (FORMAT == FORMAT_FP8) {
        lo = fp8_to_float16(_mm512_cvtepu8_epi32(_mm256_castsi256_si128(q)));
        hi = fp8_to_float16(_mm512_cvtepu8_epi32(_mm256_extracti128_si256(q, 1)));
    } else {
        lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q)));
        hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1)));
    }
    return _mm512_cvtne2ps_pbh(hi, lo); /* exact: integers of at most 8 bits, e4m3's 3 mantissa bits */
}

/* 32 activations from index i of the bf16 rows as they are. */
static inline operand_t activations(const void *x, int64_t i) {
    return (operand_t)_mm512_loadu_si512((const bf16_t *)x + i);
}

static inline acc_t madd(acc_t acc, operand_t a, operand_t b) { return _mm512_dpbf16_ps(acc, a, b); }

static inline float lane_sum(acc_t v) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define WIDE_ACTIVATIONS 0
#else
#define KSTEP 16
typedef __m256 acc_t;
/* 16 inputs as two vectors of 8 floats: for bf16 weights the even inputs and the odd ones (a bf16 pair in a 32-bit
 * lane gives both with one shift and one mask: two operations per 16 weights instead of four), for codes the first
 * 8 and the next 8. The activations are widened in the same order (`widen_rows`). */
typedef struct {
    __m256 a, b;
} operand_t;

static inline acc_t acc_zero(void) { return _mm256_setzero_ps(); }

/* 8 e4m3 codes (one a 32-bit lane) as float32, exactly: the exponent and mantissa bits moved to a float32's
 * places make the code's value times 2^-120 (subnormal codes land on subnormal floats the same way), so one
 * multiplication by 2^120 rebiases the exponent; then the sign. Needs subnormals kept (no -ffast-math, no DAZ). */
static inline __m256 fp8_to_float8(__m256i b) {
    const __m256i magnitude = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7f)), 20);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
    const __m256 value = _mm256_mul_ps(_mm256_castsi256_ps(magnitude), _mm256_set1_ps(0x1p120f));
    return _mm256_or_ps(value, _mm256_castsi256_ps(sign));
}

/* 8 codes as float32 (exact). */
static inline __attribute__((always_inline)) __m256 codes8(__m128i q, const int FORMAT) {
    return FORMAT == FORMAT_FP8 ? fp8_to_float8(_mm256_cvtepu8_epi32(q)) : _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
}

/* 16 weights of one channel from index i, as float32 (exact). */
static inline __attribute__((always_inline)) operand_t weights(const void *w, int64_t i, const int FORMAT) {
    if (FORMAT == FORMAT_BF16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)((const bf16_t *)w + i));
        const __m256 even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
        const __m256 odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32((int)0xFFFF0000u)));
        return (operand_t){even, odd};
    }
    const __m128i q = _mm_loadu_si128((const __m128i *)((const int8_t *)w + i));
    return (operand_t){codes8(q, FORMAT), codes8(_mm_srli_si128(q, 8), FORMAT)};
}

/* 16 activations from index i of the rows widened to float32 (`widen_rows`, in `weights`' order). */
static inline operand_t activations(const void *x, int64_t i) {
    return (operand_t){_mm256_loadu_ps((const float *)x + i), _mm256_loadu_ps((const float *)x + i + 8)};
}

static inline acc_t madd(acc_t acc, operand_t a, operand_t b) {
    return _mm256_fmadd_ps(a.b, b.b, _mm256_fmadd_ps(a.a, b.a, acc));
}

static inline float lane_sum(acc_t v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#define WIDE_ACTIVATIONS 1
#endif

static inline bf16_t to_bf16(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u)
        return (bf16_t)((bits >> 16) | 0x40); /* NaN stays NaN */
    bits += 0x7fffu + ((bits >> 16) & 1u);      /* to nearest, ties to even */
    return (bf16_t)(bits >> 16);
}

/* What one call multiplies and where its results go. */
typedef struct {
    const void *x; /* the activations as `activations` reads them: bf16, or float32 on AVX2 */
    const void *w;
    const float *scales; /* NULL for bf16 weights */
    void *out;
    int out_f32;
    int64_t N, K;
} Product;

/* Rows m0 .. m0 + R - 1 times channels n0 .. n0 + C - 1 (R, C constants where inlined: the accumulators stay in
 * registers). */
static inline __attribute__((always_inline)) void block(const Product *p, int64_t m0, int64_t n0, const int R,
                                                        const int C, const int FORMAT) {
    acc_t acc[ROWS][GROUP];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++)
            acc[r][c] = acc_zero();
    const int64_t K = p->K;
    for (int64_t k = 0; k < K; k += KSTEP) {
        operand_t w[GROUP];
        for (int c = 0; c < C; c++)
            w[c] = weights(p->w, (n0 + c) * K + k, FORMAT);
        for (int r = 0; r < R; r++) {
            const operand_t a = activations(p->x, (m0 + r) * K + k);
            for (int c = 0; c < C; c++)
                acc[r][c] = madd(acc[r][c], a, w[c]);
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < C; c++) {
            float y = lane_sum(acc[r][c]);
            if (FORMAT != FORMAT_BF16)
                y *= p->scales[n0 + c];
            const int64_t at = (m0 + r) * p->N + n0 + c;
            if (p->out_f32)
                ((float *)p->out)[at] = y;
            else
                ((bf16_t *)p->out)[at] = to_bf16(y);
        }
}

/* Channels per block for R rows: 8 for one row (8 independent sums), 4 up to 3 rows, else 2 (at most 12). */
#define CHANNELS(R) ((R) == 1 ? 8 : (R) <= 3 ? 4 : 2)

/* Rows m0 .. m0 + R - 1 of the group of GROUP channels from n0. */
static inline __attribute__((always_inline)) void group_rows(const Product *p, int64_t m0, int64_t n0, const int R,
                                                             const int FORMAT) {
    for (int c = 0; c < GROUP; c += CHANNELS(R))
        block(p, m0, n0 + c, R, CHANNELS(R), FORMAT);
}

/* Every row of one stripe of channels [n0, n1): per group of channels, blocks of ROWS rows, the rest in one. */
static inline __attribute__((always_inline)) void stripe(const Product *p, int64_t M, int64_t n0, int64_t n1,
                                                         const int FORMAT) {
    for (int64_t n = n0; n < n1; n += GROUP) {
        int64_t m = 0;
        for (; m + ROWS <= M; m += ROWS)
            group_rows(p, m, n, ROWS, FORMAT);
        switch (M - m) {
        case 5: group_rows(p, m, n, 5, FORMAT); break;
        case 4: group_rows(p, m, n, 4, FORMAT); break;
        case 3: group_rows(p, m, n, 3, FORMAT); break;
        case 2: group_rows(p, m, n, 2, FORMAT); break;
        case 1: group_rows(p, m, n, 1, FORMAT); break;
        default: break;
        }
    }
}

/* The next stripe's weights into L2 while this one multiplies (a thread's run is contiguous: stripes.h). */
static void prefetch_stripe(const Product *p, int64_t s, int64_t row_bytes) {
    if (s < 0)
        return;
    const char *start = (const char *)p->w + s * STRIPE * row_bytes;
    const int64_t n1 = (s + 1) * STRIPE < p->N ? (s + 1) * STRIPE : p->N;
    const int64_t bytes = (n1 - s * STRIPE) * row_bytes;
    for (int64_t b = 0; b < bytes; b += 64)
        _mm_prefetch(start + b, _MM_HINT_T1);
}

#if WIDE_ACTIVATIONS
static __thread float *wide_x;
static __thread size_t wide_capacity;

/* bf16 rows as float32 (exact) in this thread's buffer, kept between calls, per 16 inputs in `weights`' order (the
 * even then the odd ones where `split`: for bf16 weights); NULL when out of memory. */
static const float *widen_rows(const bf16_t *x, int64_t count, int split) {
    const size_t bytes = (size_t)count * sizeof(float);
    if (bytes > wide_capacity) {
        free(wide_x);
        wide_x = aligned_alloc(64, (bytes + 63) / 64 * 64);
        wide_capacity = wide_x ? bytes : 0;
    }
    if (!wide_x)
        return NULL;
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t i = 0; i < count; i += 16) {
        const __m256i v = _mm256_loadu_si256((const __m256i *)(x + i));
        __m256i first, second;
        if (split) {
            first = _mm256_slli_epi32(v, 16);
            second = _mm256_and_si256(v, high);
        } else {
            first = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16);
            second = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16);
        }
        _mm256_storeu_ps(wide_x + i, _mm256_castsi256_ps(first));
        _mm256_storeu_ps(wide_x + i + 8, _mm256_castsi256_ps(second));
    }
    return wide_x;
}
#endif

static int product(const bf16_t *x, const void *w, int format, const float *scales, void *out, int out_f32,
                   int64_t M, int64_t N, int64_t K, int threads) {
    if (M < 1 || N < 16 || K < 32 || N % 16 || K % 32 || format < FORMAT_BF16 || format > FORMAT_FP8 ||
        (format != FORMAT_BF16 && !scales))
        return -1;
#if WIDE_ACTIVATIONS
    const void *xa = widen_rows(x, M * K, format == FORMAT_BF16);
#else
    const void *xa = x;
#endif
    if (!xa)
        return -1;
    const Product p = {xa, w, scales, out, out_f32, N, K};
    const int64_t stripes = (N + STRIPE - 1) / STRIPE, row_bytes = K * (format == FORMAT_BF16 ? 2 : 1);
    threads = team_size(threads, stripes);
    StripeRun runs[MAX_STRIPE_THREADS];
    stripe_runs_init(runs, stripes, threads);
#pragma omp parallel num_threads(threads)
    {
        int64_t s, ahead;
        while ((s = stripe_take(runs, threads, omp_get_thread_num(), &ahead)) >= 0) {
            prefetch_stripe(&p, ahead, row_bytes);
            const int64_t n0 = s * STRIPE, n1 = n0 + STRIPE < N ? n0 + STRIPE : N;
            if (format == FORMAT_INT8)
                stripe(&p, M, n0, n1, FORMAT_INT8);
            else if (format == FORMAT_FP8)
                stripe(&p, M, n0, n1, FORMAT_FP8);
            else
                stripe(&p, M, n0, n1, FORMAT_BF16);
        }
    }
    return 0;
}

/* y = x @ w^T rounded to bf16: `format` 0, w bf16 (`scales` unused); 1, int8 codes times `scales` per channel;
 * 2, e4m3 codes times `scales`.
 * 0 when done, -1 when these shapes cannot (the caller multiplies in torch). */
int skinny_gemm(const bf16_t *x, const void *w, const float *scales, bf16_t *out, int64_t M, int64_t N, int64_t K,
                int format, int threads) {
    return product(x, w, format, scales, out, 0, M, N, K, threads);
}

/* The same sums in float32, unrounded (an LM head's logits). */
int skinny_gemm_f32(const bf16_t *x, const void *w, const float *scales, float *out, int64_t M, int64_t N, int64_t K,
                    int format, int threads) {
    return product(x, w, format, scales, out, 1, M, N, K, threads);
}

/* Which build this is: 2 for AVX-512 BF16, 1 for AVX2 (kernels/cpu_isa.py checks it loaded the one it asked for). */
int vector_gemm_isa(void) { return WIDE_ACTIVATIONS ? 1 : 2; }
