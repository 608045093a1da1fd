/* Greedy sampling's argmax over the rows of a [rows, cols] logits matrix, for CPU workers.
 *
 * At 256 rows of a 49,152-token vocabulary the logits are 50 MB of float32: the argmax is bound by reading them,
 * so each row is read once, rows are shared by the threads when the matrix outgrows the cache, and a bfloat16
 * matrix is read as it is (half the bytes; widening a bfloat16 to float32 is exact, so the result is that of the
 * widened row).
 *
 * The answer is torch's: the first maximum on ties, and a row with a NaN answers its first NaN (NaN is greater
 * than everything). Hence no -ffast-math here (it would let the compiler assume there is no NaN).
 *
 * With AVX2 a row is read once, a block of 32 values at a time (described at VECTOR_ARGMAX), then one block of it
 * again from the cache; a row with a NaN goes to the scalar path, which answers its first NaN. Measured against a
 * first pass for the maximum and a second for its index, and against an index kept per value: no slower at 49,152
 * columns, faster on rows that fit the cache (docs/benchmarks.md).
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

/* One pass over the whole blocks: each block's four vectors reduced to one with max; each lane keeps the largest
 * value it has seen and the first block where it saw it (a strict "greater than": a tie keeps the earlier block),
 * noting any NaN. The row's first maximum lies in the earliest block that some lane holding the row's maximum
 * recorded (an earlier occurrence would have been recorded first), and one scan of that block finds it. */
#define VECTOR_ARGMAX(NAME, T, LOAD8, SCALAR, LOAD)                                               \
    static int64_t NAME(const T *x, int64_t n) {                                                  \
        if (n < BLOCK || n > INT32_MAX) return SCALAR(x, n);                                      \
        const int64_t whole = n / BLOCK * BLOCK;                                                  \
        __m256 best = _mm256_set1_ps(-INFINITY), nan = _mm256_setzero_ps();                       \
        __m256i best_block = _mm256_setzero_si256();                                              \
        for (int64_t i = 0; i < whole; i += BLOCK) {                                              \
            const __m256 a = LOAD8(x + i), b = LOAD8(x + i + 8);                                  \
            const __m256 c = LOAD8(x + i + 16), d = LOAD8(x + i + 24);                            \
            nan = _mm256_or_ps(nan, _mm256_or_ps(unordered(a, b), unordered(c, d)));              \
            const __m256 top = _mm256_max_ps(_mm256_max_ps(a, b), _mm256_max_ps(c, d));           \
            const __m256 gt = _mm256_cmp_ps(top, best, _CMP_GT_OQ);                               \
            best = _mm256_blendv_ps(best, top, gt);                                               \
            best_block = _mm256_castps_si256(_mm256_blendv_ps(                                    \
                _mm256_castsi256_ps(best_block), _mm256_castsi256_ps(_mm256_set1_epi32((int32_t)i)), gt)); \
        }                                                                                         \
        if (_mm256_movemask_ps(nan)) return SCALAR(x, n);                                         \
        float values[8];                                                                          \
        int32_t blocks[8];                                                                        \
        _mm256_storeu_ps(values, best);                                                           \
        _mm256_storeu_si256((__m256i *)blocks, best_block);                                       \
        float top = values[0];                                                                    \
        int64_t first = blocks[0];                                                                \
        for (int k = 1; k < 8; k++) {                                                             \
            if (values[k] > top || (values[k] == top && blocks[k] < first)) {                     \
                top = values[k];                                                                  \
                first = blocks[k];                                                                \
            }                                                                                     \
        }                                                                                         \
        int64_t at = first;                                                                       \
        while (LOAD(x, at) != top) at++; /* within the block: it holds `top` */                  \
        for (int64_t i = whole; i < n; i++) { /* the tail: past every block */                    \
            const float v = LOAD(x, i);                                                           \
            if (isnan(v)) return i; /* the first NaN: the blocks have none */                     \
            if (v > top) {                                                                        \
                top = v;                                                                          \
                at = i;                                                                           \
            }                                                                                     \
        }                                                                                         \
        return at;                                                                                \
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
void argmax_rows(const void *logits, int64_t rows, int64_t cols, int64_t stride, int bf16, int64_t *out,
                 int threads) {
    /* Rows shared by `threads` only when the matrix is far larger than the cache: below, the fork and join cost
     * more than a second core's bandwidth brings (256 x 1,024 float32 takes ~50 us on one). */
    const int parallel = threads > 1 && rows > 1 && rows * cols >= (1 << 20);
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (int64_t r = 0; r < rows; r++) {
        out[r] = bf16 ? row_bf16((const uint16_t *)logits + r * stride, cols)
                      : row_f32((const float *)logits + r * stride, cols);
    }
}
