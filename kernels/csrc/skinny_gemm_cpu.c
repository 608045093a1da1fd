/* Skinny matrix products for CPU decode steps: y [M, N] = x [M, K] @ w [N, K]^T, M <= 64 rows, on AMX tiles.
 *
 * A decode step multiplies a few rows of activations by every weight of the model, so it is bound by reading the
 * weights; torch's bf16 matmul (oneDNN) reads them far slower than memory allows at these row counts, and its
 * int8 weight-only paths either walk the weights once per row (`_weight_int8pack_mm`) or convert every code to
 * bf16 in memory each step. Here each 16-output-channel x 32-input block of the weight is read once per step,
 * straight from the layout torch keeps ([N, K] row-major: no repacking, no copy): bf16 rows are loaded into an
 * AMX tile as they are; int8 rows are widened to bf16 in registers (exact: |code| <= 127 fits bf16's 8 bits of
 * precision) into a 1 KiB scratch tile first, their per-channel scale applied to the output.
 *
 * The weight block is the tile product's A operand (16 channels x 32 inputs) and the activations are B (32
 * inputs x 16 rows, pairs of inputs interleaved: the layout TDPBF16PS wants, made once per call in `xt`), so the
 * accumulator holds y^T [16 channels, 16 rows]: up to 4 of them cover 64 rows, each reusing the weight tile. They
 * are transposed in registers on the way out. Rows past M are zeros in `xt` (an accumulator is always 16 wide:
 * AMX's cost is one tile product per 512 weights, small beside reading them). Threads (OpenMP) split the output
 * channels in stripes of 32: each its own run of them, prefetching its next stripe while one multiplies, then
 * stripes from the back of another's run (stripes.h). Products accumulate in float32 and round to bf16 once, as
 * torch's bf16 matmul does.
 *
 * Requirements (the caller checks): K % 32 == 0, N % 16 == 0, 1 <= M <= 64, everything contiguous; x and out
 * bf16; scales float32 [N] (int8) or NULL (bf16).
 *
 * `int8_gemm` multiplies int8 codes by activations quantized per row on the fly (AMX-INT8, TDPBSSD: 16 x 16 x 64
 * per tile product, half of bf16's tile products per weight, and no widening: the codes go from memory straight
 * into the tiles). With 8-bit activations (x ~ x_scale[m] * q, |q| <= 127) it is W8A8; with 16 bits each row's
 * codes q (|q| <= 127 * 256 + 127) are split into q = 256 hi + lo, hi and lo int8, and both multiplied (two tile
 * products per 64 inputs, as many as bf16, but still no widening and half the weight bytes): about 15 bits per
 * activation, as fine as bf16's own rounding for SmolLM2's outlier channels. Any row count (prefill too).
 */
#include <stdlib.h>

#include <omp.h>

#include "amx_tiles.h"
#include "bf16_vectors.h"
#include "stripes.h"

#define MAX_ROWS 64
#define GROUP_ROWS 16 /* activation rows per accumulator tile */
#define BLOCK_N 16    /* output channels per tile */
#define BLOCK_K 32    /* inputs per tile product (16 pairs of bf16) */

/* int8 codes are read this many bytes ahead into L2: the next stripe's arrive while this one's tiles multiply
 * (32 KiB measured best of 0, 8, 16, 32, 64 and 128 KiB on the SmolLM2 shapes). */
#define PREFETCH_AHEAD 32768

#define WEIGHT_BF16 0
#define WEIGHT_INT8 1

#if HAVE_AMX && defined(__AMX_INT8__)
#define HAVE_AMX_INT8 1
#else
#define HAVE_AMX_INT8 0
#endif
#define QUADS_K 64 /* int8 inputs per tile product (16 quads of 4) */

#if HAVE_AMX
static void make_tables(void);
#endif

/* 1 when the tiles can be used in this process (Linux hands out AMX state on request), else 0. */
int skinny_gemm_init(void) {
#if HAVE_AMX
    make_tables();
    return amx_request_permission();
#else
    return 0;
#endif
}

#if HAVE_AMX

/* xt[g][p][r] = the bf16 pair x[16g + r, 2p : 2p + 2] as one 32-bit word, zero for rows past M. */
static void interleave_rows(const uint32_t *x, uint32_t *xt, int64_t M, int64_t K, int groups) {
    const int64_t pairs = K / 2;
    memset(xt, 0, (size_t)groups * pairs * GROUP_ROWS * sizeof(uint32_t));
    for (int64_t m = 0; m < M; m++) {
        uint32_t *dst = xt + (m / GROUP_ROWS) * pairs * GROUP_ROWS + m % GROUP_ROWS;
        const uint32_t *src = x + m * pairs;
        for (int64_t p = 0; p < pairs; p++)
            dst[p * GROUP_ROWS] = src[p];
    }
}

/* bf16 bits of the integers 0..127, high and low bytes (filled by skinny_gemm_init). */
static _Alignas(64) uint8_t high_bytes[128], low_bytes[128];
/* Byte j of a 64-byte result: low byte (from the first operand) then high byte (64 +: the second) of code j. */
static _Alignas(64) uint8_t interleave_first[64], interleave_second[64];

static void make_tables(void) {
    for (int i = 0; i < 128; i++) {
        const float value = (float)i;
        uint32_t bits;
        memcpy(&bits, &value, sizeof bits);
        high_bytes[i] = (uint8_t)(bits >> 24);
        low_bytes[i] = (uint8_t)(bits >> 16);
    }
    for (int j = 0; j < 32; j++) {
        interleave_first[2 * j] = (uint8_t)j, interleave_first[2 * j + 1] = (uint8_t)(64 + j);
        interleave_second[2 * j] = (uint8_t)(32 + j), interleave_second[2 * j + 1] = (uint8_t)(96 + j);
    }
}

/* `rows` rows of int8 codes (K each) widened to bf16 rows in `wide`, 64 codes at a time by table lookup: the
 * bytes of bf16(|code|) from two 128-entry tables (|code| <= 127), the code's sign bit into the high byte, the
 * bytes interleaved into two vectors of 32 bf16 (6 shuffles per 64 codes, half of converting through float32). */
static void widen_int8_rows(const int8_t *w, int64_t rows, int64_t K, uint16_t *wide) {
    const __m512i high0 = _mm512_load_si512(high_bytes), high1 = _mm512_load_si512(high_bytes + 64);
    const __m512i low0 = _mm512_load_si512(low_bytes), low1 = _mm512_load_si512(low_bytes + 64);
    const __m512i first = _mm512_load_si512(interleave_first), second = _mm512_load_si512(interleave_second);
    const __m512i sign = _mm512_set1_epi8((char)0x80);
    for (int64_t i = 0; i < rows * K; i += 64) {
        _mm_prefetch((const char *)(w + i + PREFETCH_AHEAD), _MM_HINT_T1);
        const __m512i codes = _mm512_loadu_si512(w + i), magnitude = _mm512_abs_epi8(codes);
        const __m512i low = _mm512_permutex2var_epi8(low0, magnitude, low1);
        const __m512i high = _mm512_or_si512(_mm512_permutex2var_epi8(high0, magnitude, high1),
                                             _mm512_and_si512(codes, sign));
        _mm512_store_si512(wide + i, _mm512_permutex2var_epi8(low, first, high));
        _mm512_store_si512(wide + i + 32, _mm512_permutex2var_epi8(low, second, high));
    }
}

/* Element j of the two-source permutes of transpose16's stage b: the low half of each swapped pair of b x b blocks
 * (from r[i], then r[i + b]) and the high half. */
#define STAGE_LOW(b, j) (((j) & (b)) ? 16 + (j) - (b) : (j))
#define STAGE_HIGH(b, j) (((j) & (b)) ? 16 + (j) : (j) + (b))
#define STAGE_INDEX(F, b)                                                                                            \
    _mm512_setr_epi32(F(b, 0), F(b, 1), F(b, 2), F(b, 3), F(b, 4), F(b, 5), F(b, 6), F(b, 7), F(b, 8), F(b, 9),      \
                      F(b, 10), F(b, 11), F(b, 12), F(b, 13), F(b, 14), F(b, 15))

/* One stage of transpose16: swap the off-diagonal b x b blocks of each 2b x 2b block. Inlined with b constant and
 * the loop unrolled, so that r stays in registers (a loop over b with indices made at run time kept r on the
 * stack: a third of the int8 kernel's time at 64 rows went to its loads and stores). */
static inline __attribute__((always_inline)) void transpose_stage(__m512 r[16], const int b, __m512i lo, __m512i hi) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; i++) {
        if (i & b)
            continue;
        const __m512 a = r[i], c = r[i + b];
        r[i] = _mm512_permutex2var_ps(a, lo, c);
        r[i + b] = _mm512_permutex2var_ps(a, hi, c);
    }
}

/* Transpose a 16 x 16 float32 block in registers: at each step, swap the off-diagonal b x b blocks. */
static inline __attribute__((always_inline)) void transpose16(__m512 r[16]) {
    transpose_stage(r, 8, STAGE_INDEX(STAGE_LOW, 8), STAGE_INDEX(STAGE_HIGH, 8));
    transpose_stage(r, 4, STAGE_INDEX(STAGE_LOW, 4), STAGE_INDEX(STAGE_HIGH, 4));
    transpose_stage(r, 2, STAGE_INDEX(STAGE_LOW, 2), STAGE_INDEX(STAGE_HIGH, 2));
    transpose_stage(r, 1, STAGE_INDEX(STAGE_LOW, 1), STAGE_INDEX(STAGE_HIGH, 1));
}

/* 16 float32 results to `out` + at: rounded to bf16, or as they are (`out_f32`). */
static inline void store_row(__m512 y, void *out, int out_f32, int64_t at) {
    if (out_f32)
        _mm512_storeu_ps((float *)out + at, y);
    else
        float_to_bf16x16((uint16_t *)out + at, y);
}

/* The accumulator of one row group (y^T, 16 channels x 16 rows) out to y's rows (`out` + the group's first
 * element), scaled per channel. */
static inline void store_group(const float *acc, const float *scales, void *out, int out_f32, int64_t first,
                               int64_t rows, int64_t N) {
    __m512 r[16];
    for (int i = 0; i < 16; i++)
        r[i] = _mm512_load_ps(acc + 16 * i);
    transpose16(r);
    const __m512 s = scales ? _mm512_loadu_ps(scales) : _mm512_set1_ps(1.0f);
    for (int64_t m = 0; m < rows; m++)
        store_row(_mm512_mul_ps(r[m], s), out, out_f32, first + m * N);
}

/* The weights a thread will multiply next (`Ahead`: its next stripe, stripes.h; bytes 0: none), fetched into L2
 * while a stripe's tiles multiply, a slice per k block: the tile loads' 16 rows at a stride of K are not a stream
 * the hardware prefetchers follow well. */
typedef struct {
    const char *start;
    int64_t bytes;
} Ahead;

static inline Ahead ahead_of(const void *w, int64_t stripe, int64_t N, int64_t row_bytes) {
    if (stripe < 0)
        return (Ahead){NULL, 0};
    const int64_t n0 = stripe * 2 * BLOCK_N, width = N - n0 < 2 * BLOCK_N ? N - n0 : 2 * BLOCK_N;
    return (Ahead){(const char *)w + n0 * row_bytes, width * row_bytes};
}

static inline void prefetch_slice(Ahead ahead, int64_t kb, int64_t blocks) {
#ifndef NO_PREFETCH
    for (int64_t i = kb * ahead.bytes / blocks; i < (kb + 1) * ahead.bytes / blocks; i += 64)
        _mm_prefetch(ahead.start + i, _MM_HINT_T1);
#else
    (void)ahead, (void)kb, (void)blocks;
#endif
}

/* One stripe of 16 or 32 output channels (`width`) from n0, for every row: the stripe's weights (widened to bf16
 * first for int8) are tiles 4 and 5, two row groups' activations tiles 6 and 7, and four accumulators 0-3 (group
 * x channel half) are independent, so consecutive tile products do not wait on each other. */
static void stripe_product(const void *w, int format, const float *scales, const uint32_t *xt, void *out,
                           int out_f32, int64_t M, int64_t N, int64_t K, int groups, int64_t n0, int width,
                           uint16_t *wide, float *acc, Ahead ahead) {
    const int64_t pairs = K / 2, stride = K * 2;
    const uint16_t *a = (const uint16_t *)w + n0 * K;
    if (format == WEIGHT_INT8) {
        widen_int8_rows((const int8_t *)w + n0 * K, width, K, wide);
        a = wide;
    }
    const int full = width == 2 * BLOCK_N;
    for (int g = 0; g < groups; g += 2) {
        const int two = groups - g > 1;
        const uint32_t *b0 = xt + (int64_t)g * pairs * GROUP_ROWS, *b1 = b0 + pairs * GROUP_ROWS;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < K / BLOCK_K; kb++) {
            if (g == 0 && format == WEIGHT_BF16)
                prefetch_slice(ahead, kb, K / BLOCK_K);
            _tile_loadd(4, a + kb * BLOCK_K, stride);
            _tile_loadd(6, b0 + kb * 16 * GROUP_ROWS, 64);
            _tile_dpbf16ps(0, 4, 6);
            if (full) {
                _tile_loadd(5, a + 16 * K + kb * BLOCK_K, stride);
                _tile_dpbf16ps(1, 5, 6);
            }
            if (two) {
                _tile_loadd(7, b1 + kb * 16 * GROUP_ROWS, 64);
                _tile_dpbf16ps(2, 4, 7);
                if (full)
                    _tile_dpbf16ps(3, 5, 7);
            }
        }
        for (int t = 0; t < 4; t++) {
            const int64_t first = (int64_t)(g + t / 2) * GROUP_ROWS, channel = n0 + (t % 2) * BLOCK_N;
            if (first >= M || (t % 2 && !full))
                continue;
            switch (t) {
            case 0: _tile_stored(0, acc, 64); break;
            case 1: _tile_stored(1, acc, 64); break;
            case 2: _tile_stored(2, acc, 64); break;
            default: _tile_stored(3, acc, 64); break;
            }
            const int64_t rows = M - first < GROUP_ROWS ? M - first : GROUP_ROWS;
            store_group(acc, scales ? scales + channel : NULL, out, out_f32, first * N + channel, rows, N);
        }
    }
}

static __thread void *wide_buffer;
static __thread size_t wide_capacity;

/* This thread's buffer of at least `bytes` (kept between calls), or NULL. */
static void *thread_buffer(void **buffer, size_t *capacity, size_t bytes) {
    if (bytes > *capacity) {
        free(*buffer);
        *buffer = aligned_alloc(64, (bytes + 63) / 64 * 64);
        *capacity = *buffer ? bytes : 0;
    }
    return *buffer;
}

static __thread void *xt_buffer;
static __thread size_t xt_capacity;

#endif /* HAVE_AMX */

#if HAVE_AMX_INT8

/* Tile `t` (0-3: a constant for the instruction) stored to `buffer`. */
static inline void store_tile(int t, void *buffer) {
    switch (t) {
    case 0: _tile_stored(0, buffer, 64); break;
    case 1: _tile_stored(1, buffer, 64); break;
    case 2: _tile_stored(2, buffer, 64); break;
    default: _tile_stored(3, buffer, 64); break;
    }
}

/* 16 int32 codes as 16 bytes, 4 inputs per 32-bit word, to `dst[0], dst[16], dst[32], dst[48]` (a tile's rows). */
static inline void scatter_quads(__m512i codes, uint32_t *dst) {
    _Alignas(16) uint32_t words[4];
    _mm_store_si128((__m128i *)words, _mm512_cvtsepi32_epi8(codes));
    for (int j = 0; j < 4; j++)
        dst[j * GROUP_ROWS] = words[j];
}

/* Inputs k..k+15 of an activation row: bf16 as they are, or silu(gate) * up from a gated MLP's [gate | up] row
 * (`gated`: up starts K elements after gate), in float32 (no bf16 rounding between the two, unlike torch's). */
static inline __m512 load_inputs(const uint16_t *x, int64_t k, int64_t K, int gated) {
    const __m512 v = bf16x16_to_float(x + k);
    if (!gated)
        return v;
    return silu_mul16(v, bf16x16_to_float(x + K + k));
}

/* The largest |input| of inputs [k0, k1) of an activation row (bf16, or a gated MLP's: `load_inputs`, those
 * kept in `gated` [K] for `quantize_inputs`). */
static float inputs_absmax(const uint16_t *x, int64_t k0, int64_t k1, int64_t K, float *gated) {
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = k0; k < k1; k += 16) {
        const __m512 v = load_inputs(x, k, K, gated != NULL);
        if (gated)
            _mm512_store_ps(gated + k, v);
        amax = _mm512_max_ps(amax, _mm512_abs_ps(v));
    }
    return _mm512_reduce_max_ps(amax);
}

static inline float code_limit(int split) { return split ? 127.0f * 256 + 127 : 127.0f; }

/* Inputs [k0, k1) of one row quantized symmetrically (|input| <= absmax) into its tile column(s): `hi` (and `lo`
 * when split: 16-bit codes cut into 256 hi + lo). k0 and k1 are multiples of 16, so a call writes only the tile
 * words of its own inputs (4 per word). */
static void quantize_inputs(const uint16_t *x, int64_t k0, int64_t k1, const float *gated, float absmax, int split,
                            uint32_t *hi, uint32_t *lo) {
    const float qmax = code_limit(split);
    const __m512 inv = _mm512_set1_ps(absmax > 0 ? qmax / absmax : 0.0f);
    const __m512i top = _mm512_set1_epi32((int)qmax), bottom = _mm512_set1_epi32(-(int)qmax);
    for (int64_t k = k0; k < k1; k += 16) {
        const __m512 v = gated ? _mm512_load_ps(gated + k) : bf16x16_to_float(x + k);
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v, inv)); /* to nearest */
        q = _mm512_max_epi32(_mm512_min_epi32(q, top), bottom);
        if (split) {
            /* hi = floor((q + 128) / 256) in [-127, 127], lo = q - 256 hi in [-128, 127] */
            const __m512i h = _mm512_srai_epi32(_mm512_add_epi32(q, _mm512_set1_epi32(128)), 8);
            scatter_quads(_mm512_sub_epi32(q, _mm512_slli_epi32(h, 8)), lo + k / 4 * GROUP_ROWS);
            q = h;
        }
        scatter_quads(q, hi + k / 4 * GROUP_ROWS);
    }
}

/* An int32 accumulator (y^T, 16 channels x 16 rows; plus 256 x it and `lo`'s when split) out to y's rows (`out`
 * + at: the group's first element), scaled by the channels' and the rows' scales: bf16, or float32 (`out_f32`:
 * an LM head's logits, kept unrounded). */
static inline void store_int8_group(const int32_t *acc, const int32_t *lo, const float *w_scales,
                                    const float *x_scales, void *out, int out_f32, int64_t at, int64_t rows,
                                    int64_t N) {
    __m512 r[16];
    for (int i = 0; i < 16; i++) {
        r[i] = _mm512_cvtepi32_ps(_mm512_load_si512(acc + 16 * i));
        if (lo)
            r[i] = _mm512_fmadd_ps(r[i], _mm512_set1_ps(256.0f), _mm512_cvtepi32_ps(_mm512_load_si512(lo + 16 * i)));
    }
    transpose16(r);
    const __m512 s = _mm512_loadu_ps(w_scales);
    for (int64_t m = 0; m < rows; m++)
        store_row(_mm512_mul_ps(r[m], _mm512_mul_ps(s, _mm512_set1_ps(x_scales[m]))), out, out_f32, at + m * N);
}

/* One stripe of 16 or 32 output channels from n0, for every row: the stripe's codes straight from memory are
 * tiles 4 and 5, two "virtual groups" of activations tiles 6 and 7 (two row groups; or, split, one row group's hi
 * and lo codes), accumulators 0-3 (virtual group x channel half). */
static void stripe_int8(const int8_t *w, const float *w_scales, const uint32_t *xq, const float *x_scales,
                        void *out, int out_f32, int64_t M, int64_t N, int64_t K, int vgroups, int split, int64_t n0,
                        int width, int32_t *acc, int32_t *acc_lo, Ahead ahead) {
    const int64_t quads = K / 4;
    const int8_t *a = w + n0 * K;
    const int full = width == 2 * BLOCK_N;
    for (int vg = 0; vg < vgroups; vg += 2) {
        const int two = vgroups - vg > 1;
        const uint32_t *b0 = xq + (int64_t)vg * quads * GROUP_ROWS, *b1 = b0 + quads * GROUP_ROWS;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = 0; kb < K / QUADS_K; kb++) {
            if (vg == 0)
                prefetch_slice(ahead, kb, K / QUADS_K);
            _tile_loadd(4, a + kb * QUADS_K, K);
            _tile_loadd(6, b0 + kb * 16 * GROUP_ROWS, 64);
            _tile_dpbssd(0, 4, 6);
            if (full) {
                _tile_loadd(5, a + 16 * K + kb * QUADS_K, K);
                _tile_dpbssd(1, 5, 6);
            }
            if (two) {
                _tile_loadd(7, b1 + kb * 16 * GROUP_ROWS, 64);
                _tile_dpbssd(2, 4, 7);
                if (full)
                    _tile_dpbssd(3, 5, 7);
            }
        }
        for (int t = 0; t < (split ? 2 : 4); t++) {
            const int64_t first = (int64_t)(split ? vg / 2 : vg + t / 2) * GROUP_ROWS, channel = n0 + (t % 2) * BLOCK_N;
            if (first >= M || (t % 2 && !full))
                continue;
            store_tile(t, acc);
            if (split)
                store_tile(t + 2, acc_lo);
            const int64_t rows = M - first < GROUP_ROWS ? M - first : GROUP_ROWS;
            store_int8_group(acc, split ? acc_lo : NULL, w_scales + channel, x_scales + first, out, out_f32,
                             first * N + channel, rows, N);
        }
    }
}

static __thread void *xq_buffer, *xs_buffer, *gated_buffer;
static __thread size_t xq_capacity, xs_capacity, gated_capacity;

#endif /* HAVE_AMX_INT8 */

#if HAVE_AMX
static int skinny_product(const uint16_t *x, const void *w, const float *scales, void *out, int out_f32, int64_t M,
                          int64_t N, int64_t K, int format, int num_threads) {
    if (M < 1 || M > MAX_ROWS || N % BLOCK_N || K % BLOCK_K || K <= 0 || N <= 0)
        return -1;
    const int groups = (int)((M + GROUP_ROWS - 1) / GROUP_ROWS);
    uint32_t *xt = thread_buffer(&xt_buffer, &xt_capacity,
                                 (size_t)groups * (K / 2) * GROUP_ROWS * sizeof(uint32_t));
    if (!xt)
        return -1;
    interleave_rows((const uint32_t *)x, xt, M, K, groups);
    const int64_t stripes = (N + 2 * BLOCK_N - 1) / (2 * BLOCK_N);
    num_threads = team_size(num_threads, stripes);
    StripeRun runs[MAX_STRIPE_THREADS];
    stripe_runs_init(runs, stripes, num_threads);
    const int64_t row_bytes = format == WEIGHT_INT8 ? K : 2 * K;
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint16_t *wide = NULL;
        if (format == WEIGHT_INT8)
            wide = thread_buffer(&wide_buffer, &wide_capacity, (size_t)2 * BLOCK_N * K * sizeof(uint16_t));
        failed = format == WEIGHT_INT8 && !wide;
        _Alignas(64) float acc[16 * 16];
        configure_tiles();
        int64_t s, next;
        while ((s = stripe_take(runs, num_threads, omp_get_thread_num(), &next)) >= 0) {
            const int64_t n0 = s * 2 * BLOCK_N;
            const int width = N - n0 < 2 * BLOCK_N ? (int)(N - n0) : 2 * BLOCK_N;
            if (!failed)
                stripe_product(w, format, scales, xt, out, out_f32, M, N, K, groups, n0, width, wide, acc,
                               ahead_of(w, next, N, row_bytes));
        }
        _tile_release();
    }
    return failed ? -1 : 0;
}
#endif

#if HAVE_AMX_INT8
/* A call's activation rows and the tile words they are quantized into. */
typedef struct {
    const uint16_t *x;
    int64_t K;
    int gated, split;
    uint32_t *xq;
    int64_t words; /* one virtual group's tile words */
} Activations;

static inline const uint16_t *row_inputs(Activations a, int64_t m) { return a.x + m * (a.K << a.gated); }

/* Row m's column of its group's hi tile words (its lo words follow `words` later). */
static inline uint32_t *row_codes(Activations a, int64_t m) {
    return a.xq + ((m / GROUP_ROWS) << a.split) * a.words + m % GROUP_ROWS;
}

/* Inputs [k0, k1) of row m quantized into its tile words, given the row's largest |input| (`kept`: the row's gated
 * inputs as inputs_absmax kept them, or NULL). */
static inline void quantize_row_part(Activations a, int64_t m, int64_t k0, int64_t k1, const float *kept,
                                     float absmax) {
    quantize_inputs(row_inputs(a, m), k0, k1, kept, absmax, a.split, row_codes(a, m), row_codes(a, m) + a.words);
}

/* Rows [0, M) quantized by the whole team, thread t of `team` a slice of every row's inputs (slices of 16 inputs
 * are whole cache lines of the tile words: no line is written by two threads): each slice's maximum to
 * `partial`, a barrier, then each row's codes from the maximum of its slices'. `values` NULL: skip (a failed
 * buffer; the call fails). Ends with a barrier: every code is written when it returns. */
static void quantize_slices(Activations a, int64_t M, float *values, float *xs, float partial[][MAX_ROWS], int t,
                            int team) {
    const int64_t slices = a.K / 16, k0 = t * slices / team * 16, k1 = (t + 1) * slices / team * 16;
    const int skip = a.gated && !values;
    for (int64_t m = 0; m < M && !skip; m++)
        partial[t][m] = inputs_absmax(row_inputs(a, m), k0, k1, a.K, a.gated ? values + m * a.K : NULL);
#pragma omp barrier
    for (int64_t m = 0; m < M && !skip; m++) {
        float absmax = 0.0f;
        for (int j = 0; j < team; j++)
            absmax = partial[j][m] > absmax ? partial[j][m] : absmax;
        quantize_row_part(a, m, k0, k1, a.gated ? values + m * a.K : NULL, absmax);
        if (t == 0)
            xs[m] = absmax / code_limit(a.split);
    }
#pragma omp barrier
}

static int int8_product(const uint16_t *x, const int8_t *w, const float *w_scales, void *out, int out_f32,
                        int64_t M, int64_t N, int64_t K, int gated, int act_bits, int num_threads) {
    if (M < 1 || N <= 0 || K <= 0 || N % BLOCK_N || K % QUADS_K || (act_bits != 8 && act_bits != 16))
        return -1;
    const int split = act_bits == 16, groups = (int)((M + GROUP_ROWS - 1) / GROUP_ROWS), vgroups = groups << split;
    const int64_t words = K / 4 * GROUP_ROWS; /* one virtual group's tile words */
    uint32_t *xq = thread_buffer(&xq_buffer, &xq_capacity, (size_t)vgroups * words * sizeof(uint32_t));
    float *xs = thread_buffer(&xs_buffer, &xs_capacity, (size_t)M * sizeof(float));
    if (!xq || !xs)
        return -1;
    /* the last row group's rows past M stay zero */
    memset(xq + (int64_t)(groups - 1) * (words << split), 0, (size_t)(words << split) * sizeof(uint32_t));
    const int64_t stripes = (N + 2 * BLOCK_N - 1) / (2 * BLOCK_N);
    num_threads = team_size(num_threads, stripes);
    StripeRun runs[MAX_STRIPE_THREADS];
    stripe_runs_init(runs, stripes, num_threads);
    /* Fewer row groups than threads (decode's 16 rows or fewer): the threads quantize slices of the inputs
     * instead, each row's slices' maxima shared through `partial`. */
    const int sliced = groups < num_threads && M <= MAX_ROWS;
    _Alignas(64) float partial[MAX_STRIPE_THREADS][MAX_ROWS];
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), team = omp_get_num_threads();
        const size_t kept = gated ? (size_t)(sliced ? M : 1) * K * sizeof(float) : 0;
        float *values = gated ? thread_buffer(&gated_buffer, &gated_capacity, kept) : NULL;
        failed = gated && !values;
        const Activations a = {x, K, gated, split, xq, words};
        if (sliced) {
            quantize_slices(a, M, failed ? NULL : values, xs, partial, t, team);
        } else {
            /* A thread quantizes whole row groups: a group's rows share the cache lines of its tile words (row m
             * is word m % 16 of each), so two threads on one group would pass every line back and forth (16 rows
             * on two threads took 2.7x one thread's time). */
#pragma omp for schedule(static)
            for (int64_t g = 0; g < groups; g++) {
                const int64_t end = (g + 1) * GROUP_ROWS < M ? (g + 1) * GROUP_ROWS : M;
                for (int64_t m = g * GROUP_ROWS; m < end && !failed; m++) {
                    const float absmax = inputs_absmax(row_inputs(a, m), 0, K, K, values);
                    quantize_row_part(a, m, 0, K, values, absmax);
                    xs[m] = absmax / code_limit(split);
                }
            }
        }
        _Alignas(64) int32_t acc[16 * 16], acc_lo[16 * 16];
        configure_tiles();
        int64_t s, next;
        while ((s = stripe_take(runs, num_threads, t, &next)) >= 0) {
            const int64_t n0 = s * 2 * BLOCK_N;
            const int width = N - n0 < 2 * BLOCK_N ? (int)(N - n0) : 2 * BLOCK_N;
            stripe_int8(w, w_scales, xq, xs, out, out_f32, M, N, K, vgroups, split, n0, width, acc, acc_lo,
                        ahead_of(w, next, N, K));
        }
        _tile_release();
    }
    return failed ? -1 : 0;
}
#endif

/* Builds without the tiles (or AMX-INT8): every entry declines, and the caller uses another path. */
#if !HAVE_AMX
static int skinny_product(const uint16_t *x, const void *w, const float *scales, void *out, int out_f32, int64_t M,
                          int64_t N, int64_t K, int format, int num_threads) {
    (void)x, (void)w, (void)scales, (void)out, (void)out_f32, (void)M, (void)N, (void)K, (void)format,
        (void)num_threads;
    return -1;
}
#endif
#if !HAVE_AMX_INT8
static int int8_product(const uint16_t *x, const int8_t *w, const float *w_scales, void *out, int out_f32,
                        int64_t M, int64_t N, int64_t K, int gated, int act_bits, int num_threads) {
    (void)x, (void)w, (void)w_scales, (void)out, (void)out_f32, (void)M, (void)N, (void)K, (void)gated,
        (void)act_bits, (void)num_threads;
    return -1;
}
#endif

/* y = x @ w^T (times scales per output channel for int8 weights), bf16. Returns 0 when done, -1 when this build or
 * these shapes cannot (the caller then uses torch). */
int skinny_gemm(const uint16_t *x, const void *w, const float *scales, uint16_t *out, int64_t M, int64_t N,
                int64_t K, int format, int num_threads) {
    return skinny_product(x, w, scales, out, 0, M, N, K, format, num_threads);
}

/* `skinny_gemm` with float32 outputs, the sums unrounded (an LM head's logits: no rescoring of rounded ones). */
int skinny_gemm_f32(const uint16_t *x, const void *w, const float *scales, float *out, int64_t M, int64_t N,
                    int64_t K, int format, int num_threads) {
    return skinny_product(x, w, scales, out, 1, M, N, K, format, num_threads);
}

/* y = (x quantized per row to `act_bits` 8 or 16) @ w^T, times w_scales per output channel: int8 codes w [N, K],
 * any M. Returns 0 when done, -1 when this build or these shapes cannot (the caller then uses another path). */
int int8_gemm(const uint16_t *x, const int8_t *w, const float *w_scales, uint16_t *out, int64_t M, int64_t N,
              int64_t K, int act_bits, int num_threads) {
    return int8_product(x, w, w_scales, out, 0, M, N, K, 0, act_bits, num_threads);
}

/* `int8_gemm` with float32 outputs (an LM head's logits: no bf16 rounding, no conversion after). */
int int8_gemm_f32(const uint16_t *x, const int8_t *w, const float *w_scales, float *out, int64_t M, int64_t N,
                  int64_t K, int act_bits, int num_threads) {
    return int8_product(x, w, w_scales, out, 1, M, N, K, 0, act_bits, num_threads);
}

/* `int8_gemm` of a gated MLP's down projection: x [M, 2K] holds each row's gate then up halves, and the product
 * takes silu(gate) * up, made while the row is quantized (the activation and the multiply are not separate
 * passes over memory). */
int int8_gemm_silu_gated(const uint16_t *x, const int8_t *w, const float *w_scales, uint16_t *out, int64_t M,
                         int64_t N, int64_t K, int act_bits, int num_threads) {
    return int8_product(x, w, w_scales, out, 0, M, N, K, 1, act_bits, num_threads);
}
