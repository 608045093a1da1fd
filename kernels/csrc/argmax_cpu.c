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
 * Returns how many rows' maximum is not finite (a NaN, an infinity, or nothing but -inf): the sampler fails those
 * requests, and a step whose count is 0 needs no other look (one read of a value each row already has in cache).
 * One thread: rows shared between two threads measured slower on a shared 2-core machine, in wall time and CPU
 * (docs/benchmarks.md); one core's reads come close to what the memory gives. */
int64_t argmax_rows(const void *logits, int64_t rows, int64_t cols, int64_t stride, int bf16, int64_t *out,
                    int threads) {
    /* Rows shared by `threads` only when the matrix is far larger than the cache: below, the fork and join cost
     * more than a second core's bandwidth brings (256 x 1,024 float32 takes ~50 us on one). */
    const int parallel = threads > 1 && rows > 1 && rows * cols >= (1 << 20);
    int64_t not_finite = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel) reduction(+ : not_finite)
    for (int64_t r = 0; r < rows; r++) {
        float value;
        if (bf16) {
            const uint16_t *row = (const uint16_t *)logits + r * stride;
            out[r] = row_bf16(row, cols);
            value = bf16_value(row[out[r]]);
        } else {
            const float *row = (const float *)logits + r * stride;
            out[r] = row_f32(row, cols);
            value = row[out[r]];
        }
        not_finite += !isfinite(value);
    }
    return not_finite;
}

/* The k (<= MAX_TOP) largest values of a row, for the LM head's rescoring (worker_node/models/layers.py
 * `top_candidates`): the row's maxima per chunk of TOP_CHUNK values, the k chunks of largest maxima (the k largest
 * values lie in them: a value in any other chunk has k chunk maxima above it), then those chunks' values kept in a
 * small sorted list. Returns 0, or -1 for a row with a NaN (the caller's torch path ranks NaN first). */
#define MAX_TOP 64
#define TOP_CHUNK 256

/* Insert (value, index) into the descending list of `count` (< capacity, or dropping the last). */
static inline int top_insert(float *values, int64_t *indices, int count, int capacity, float value, int64_t index) {
    int at = count < capacity ? count : capacity - 1;
    while (at > 0 && values[at - 1] < value) {
        if (at < capacity) {
            values[at] = values[at - 1];
            indices[at] = indices[at - 1];
        }
        at--;
    }
    values[at] = value;
    indices[at] = index;
    return count < capacity ? count + 1 : count;
}

/* A chunk's maximum, or NaN when it holds one. */
#define CHUNK_MAX(NAME, T, LOAD, LOAD8)                                                                          \
    static inline float NAME(const T *x) {                                                                      \
        CHUNK_MAX_BODY(LOAD, LOAD8)                                                                             \
    }
#ifdef __AVX2__
#define CHUNK_MAX_BODY(LOAD, LOAD8)                                                                              \
    __m256 top = LOAD8(x), nan = unordered(top, top);                                                          \
    for (int i = 8; i < TOP_CHUNK; i += 8) {                                                                    \
        const __m256 v = LOAD8(x + i);                                                                          \
        nan = _mm256_or_ps(nan, unordered(v, v));                                                               \
        top = _mm256_max_ps(top, v);                                                                            \
    }                                                                                                           \
    if (_mm256_movemask_ps(nan)) return NAN;                                                                    \
    float lanes[8];                                                                                             \
    _mm256_storeu_ps(lanes, top);                                                                               \
    float best = lanes[0];                                                                                      \
    for (int l = 1; l < 8; l++) best = lanes[l] > best ? lanes[l] : best;                                       \
    return best;
#else
#define CHUNK_MAX_BODY(LOAD, LOAD8)                                                                              \
    float best = -INFINITY;                                                                                     \
    for (int i = 0; i < TOP_CHUNK; i++) {                                                                       \
        const float v = LOAD(x, i);                                                                             \
        if (v != v) return NAN;                                                                                 \
        best = v > best ? v : best;                                                                             \
    }                                                                                                           \
    return best;
#endif
CHUNK_MAX(chunk_max_f32, float, LOAD_F32, load8_f32)
CHUNK_MAX(chunk_max_bf16, uint16_t, LOAD_BF16, load8_bf16)

#define TOP_ROW(NAME, T, LOAD, CHUNK)                                                                            \
    static int NAME(const T *x, int64_t cols, int k, int64_t *out) {                                           \
        const int64_t chunks = cols / TOP_CHUNK;                                                                \
        float chunk_values[MAX_TOP], values[MAX_TOP];                                                           \
        int64_t chunk_ids[MAX_TOP];                                                                             \
        int kept = 0;                                                                                           \
        for (int64_t c = 0; c < chunks; c++) {                                                                  \
            const float top = CHUNK(x + c * TOP_CHUNK);                                                         \
            if (top != top) return -1;                                                                          \
            if (kept < k || top > chunk_values[kept - 1])                                                       \
                kept = top_insert(chunk_values, chunk_ids, kept, k, top, c);                                    \
        }                                                                                                       \
        int found = 0;                                                                                          \
        for (int j = 0; j < kept; j++)                                                                          \
            for (int64_t i = chunk_ids[j] * TOP_CHUNK; i < (chunk_ids[j] + 1) * TOP_CHUNK; i++) {               \
                const float v = LOAD(x, i);                                                                     \
                if (found < k || v > values[found - 1]) found = top_insert(values, out, found, k, v, i);       \
            }                                                                                                   \
        return 0;                                                                                               \
    }

TOP_ROW(top_row_f32, float, LOAD_F32, chunk_max_f32)
TOP_ROW(top_row_bf16, uint16_t, LOAD_BF16, chunk_max_bf16)

/* out[r, :k] = the indices of the k largest values of row r (any order; of tied values, any), for rows of whole
 * TOP_CHUNKs, more than k of them, k <= MAX_TOP. Returns 0, or -1 (nothing promised in out) when a row holds a
 * NaN or the shape is not covered. Rows shared by the threads as argmax_rows shares them. */
int top_rows(const void *logits, int64_t rows, int64_t cols, int64_t stride, int bf16, int k, int64_t *out,
             int threads) {
    if (k < 1 || k > MAX_TOP || cols % TOP_CHUNK || cols / TOP_CHUNK <= k)
        return -1;
    const int parallel = threads > 1 && rows > 1 && rows * cols >= (1 << 19);
    int failed = 0;
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel) reduction(| : failed)
    for (int64_t r = 0; r < rows; r++) {
        failed |= bf16 ? top_row_bf16((const uint16_t *)logits + r * stride, cols, k, out + r * k)
                       : top_row_f32((const float *)logits + r * stride, cols, k, out + r * k);
    }
    return failed ? -1 : 0;
}

/* A dot product of n float32 sums of exact products (bf16 x bf16 and the widened values are exact in float32). */
#if defined(__AVX2__) && defined(__FMA__)
#define DOT_BODY(LOAD8, LOAD)                                                                                    \
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();                                               \
    int64_t i = 0;                                                                                               \
    for (; i + 16 <= n; i += 16) {                                                                               \
        acc0 = _mm256_fmadd_ps(LOAD8(a + i), LOAD8(b + i), acc0);                                                \
        acc1 = _mm256_fmadd_ps(LOAD8(a + i + 8), LOAD8(b + i + 8), acc1);                                        \
    }                                                                                                            \
    __m256 acc = _mm256_add_ps(acc0, acc1);                                                                      \
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));                        \
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));                                                          \
    float sum = _mm_cvtss_f32(_mm_add_ss(half, _mm_movehdup_ps(half)));                                          \
    for (; i < n; i++)                                                                                           \
        sum += LOAD(a, i) * LOAD(b, i);                                                                          \
    return sum;
#else
#define DOT_BODY(LOAD8, LOAD)                                                                                    \
    float sum = 0.0f;                                                                                            \
    for (int64_t i = 0; i < n; i++)                                                                              \
        sum += LOAD(a, i) * LOAD(b, i);                                                                          \
    return sum;
#endif

static float dot_f32(const float *a, const float *b, int64_t n) { DOT_BODY(load8_f32, LOAD_F32) }
static float dot_bf16(const uint16_t *a, const uint16_t *b, int64_t n) { DOT_BODY(load8_bf16, LOAD_BF16) }

/* The LM head's rescoring (worker_node/models/layers.py): logits[r, top[r, j]] = hidden[r] . weight[top[r, j]] in
 * float32, for each row r and j < k, from the hidden states and weight rows as they are (bf16 or float32, both the
 * same; [rows, dim] and [vocab, dim], contiguous), without gathering the rows first. Returns 0, or -1 (nothing
 * written) when a candidate is outside [0, vocab). */
int rescore_rows(const void *hidden, const void *weight, int64_t rows, int64_t dim, int64_t vocab, int bf16,
                 const int64_t *top, int k, float *logits, int64_t stride, int threads) {
    for (int64_t i = 0; i < rows * k; i++)
        if (top[i] < 0 || top[i] >= vocab)
            return -1;
    const int parallel = threads > 1 && rows > 1 && rows * k * dim >= (1 << 16);
#pragma omp parallel for schedule(static) num_threads(threads) if (parallel)
    for (int64_t r = 0; r < rows; r++) {
        for (int j = 0; j < k; j++) {
            const int64_t v = top[r * k + j];
            logits[r * stride + v] =
                bf16 ? dot_bf16((const uint16_t *)hidden + r * dim, (const uint16_t *)weight + v * dim, dim)
                     : dot_f32((const float *)hidden + r * dim, (const float *)weight + v * dim, dim);
        }
    }
    return 0;
}
