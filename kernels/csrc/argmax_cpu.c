/* Greedy sampling's argmax over the rows of a [rows, cols] logits matrix, for CPU workers.
 *
 * At 256 rows of a 49,152-token vocabulary the logits are 50 MB of float32: the argmax is bound by reading them,
 * so each row is read once, and a bfloat16 matrix is read as it is (half the bytes; widening a bfloat16 to float32
 * is exact, so the result is that of the widened row).
 *
 * The answer is torch's: the first maximum on ties, and a row with a NaN answers its first NaN (NaN is greater
 * than everything). Hence no -ffast-math here (it would let the compiler assume there is no NaN).
 *
 * With AVX2 each row takes two passes: its largest value (noting any NaN on the way: a row with one is handed to
 * the scalar path, which answers its first NaN), then the first index that holds it. A 49,152-token row is 192 KB
 * of float32, so the second pass reads the core's cache, not the memory: the memory is read once. Keeping an
 * index per lane in one pass (a blend per vector) measured slower on rows that fit the cache.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifdef __AVX2__
#include <immintrin.h>
#endif

static inline float bf16_value(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* The scalar path (short rows, rows with a NaN, CPUs without AVX2): the first NaN if any, else the first maximum. */
#define SCALAR_ARGMAX(NAME, T, LOAD)                                                    \
    static int64_t NAME(const T *x, int64_t n) {                                        \
        int64_t best = 0;                                                               \
        float best_value = LOAD(x, 0);                                                  \
        if (isnan(best_value)) return 0;                                                \
        for (int64_t i = 1; i < n; i++) {                                               \
            const float v = LOAD(x, i);                                                 \
            if (isnan(v)) return i;                                                     \
            if (v > best_value) {                                                       \
                best_value = v;                                                         \
                best = i;                                                               \
            }                                                                           \
        }                                                                               \
        return best;                                                                    \
    }

#define LOAD_F32(x, i) ((x)[i])
#define LOAD_BF16(x, i) bf16_value((x)[i])
SCALAR_ARGMAX(scalar_f32, float, LOAD_F32)
SCALAR_ARGMAX(scalar_bf16, uint16_t, LOAD_BF16)

#ifdef __AVX2__
static inline __m256 load8_f32(const float *p) { return _mm256_loadu_ps(p); }

static inline __m256 load8_bf16(const uint16_t *p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

#define BLOCK 32 /* values per block: four vectors */

static inline __m256 unordered(__m256 a, __m256 b) { return _mm256_cmp_ps(a, b, _CMP_UNORD_Q); }

static inline float horizontal_max(__m256 v) {
    float lanes[8];
    _mm256_storeu_ps(lanes, v);
    float top = lanes[0];
    for (int k = 1; k < 8; k++) top = lanes[k] > top ? lanes[k] : top;
    return top;
}

/* Pass one: the largest value of the whole blocks (four independent maxima), noting any NaN; then the tail's.
 * Pass two: the first index holding that value, four vectors compared at a time. */
#define VECTOR_ARGMAX(NAME, T, LOAD8, SCALAR, LOAD)                                               \
    static int64_t NAME(const T *x, int64_t n) {                                                  \
        if (n < BLOCK || n > INT32_MAX) return SCALAR(x, n);                                      \
        const int64_t whole = n / BLOCK * BLOCK;                                                  \
        __m256 m0 = LOAD8(x), m1 = LOAD8(x + 8), m2 = LOAD8(x + 16), m3 = LOAD8(x + 24);          \
        __m256 nan = _mm256_or_ps(unordered(m0, m1), unordered(m2, m3));                          \
        for (int64_t i = BLOCK; i < whole; i += BLOCK) {                                          \
            const __m256 a = LOAD8(x + i), b = LOAD8(x + i + 8);                                  \
            const __m256 c = LOAD8(x + i + 16), d = LOAD8(x + i + 24);                            \
            nan = _mm256_or_ps(nan, _mm256_or_ps(unordered(a, b), unordered(c, d)));              \
            m0 = _mm256_max_ps(m0, a);                                                            \
            m1 = _mm256_max_ps(m1, b);                                                            \
            m2 = _mm256_max_ps(m2, c);                                                            \
            m3 = _mm256_max_ps(m3, d);                                                            \
        }                                                                                         \
        if (_mm256_movemask_ps(nan)) return SCALAR(x, n);                                         \
        float top = horizontal_max(_mm256_max_ps(_mm256_max_ps(m0, m1), _mm256_max_ps(m2, m3)));  \
        for (int64_t i = whole; i < n; i++) {                                                     \
            const float v = LOAD(x, i);                                                           \
            if (isnan(v)) return i; /* the first NaN: the blocks have none */                     \
            top = v > top ? v : top;                                                              \
        }                                                                                         \
        const __m256 target = _mm256_set1_ps(top);                                                \
        for (int64_t i = 0; i < whole; i += BLOCK) {                                              \
            const __m256 a = _mm256_cmp_ps(LOAD8(x + i), target, _CMP_EQ_OQ);                     \
            const __m256 b = _mm256_cmp_ps(LOAD8(x + i + 8), target, _CMP_EQ_OQ);                 \
            const __m256 c = _mm256_cmp_ps(LOAD8(x + i + 16), target, _CMP_EQ_OQ);                \
            const __m256 d = _mm256_cmp_ps(LOAD8(x + i + 24), target, _CMP_EQ_OQ);                \
            const uint32_t found = (uint32_t)_mm256_movemask_ps(a) | (uint32_t)_mm256_movemask_ps(b) << 8 | \
                                   (uint32_t)_mm256_movemask_ps(c) << 16 | (uint32_t)_mm256_movemask_ps(d) << 24; \
            if (found) return i + __builtin_ctz(found);                                           \
        }                                                                                         \
        for (int64_t i = whole;; i++) {                                                           \
            if (LOAD(x, i) == top) return i;                                                      \
        }                                                                                         \
    }

VECTOR_ARGMAX(row_f32, float, load8_f32, scalar_f32, LOAD_F32)
VECTOR_ARGMAX(row_bf16, uint16_t, load8_bf16, scalar_bf16, LOAD_BF16)
#else
#define row_f32 scalar_f32
#define row_bf16 scalar_bf16
#endif

/* out[r] = the argmax of row r of `logits` ([rows, cols], rows `stride` elements apart; bfloat16 when `bf16`).
 * One thread: rows shared between two threads measured slower on a shared 2-core machine, in wall time and CPU
 * (docs/benchmarks.md); one core's reads come close to what the memory gives. */
void argmax_rows(const void *logits, int64_t rows, int64_t cols, int64_t stride, int bf16, int64_t *out) {
    for (int64_t r = 0; r < rows; r++) {
        out[r] = bf16 ? row_bf16((const uint16_t *)logits + r * stride, cols)
                      : row_f32((const float *)logits + r * stride, cols);
    }
}
