/* AWQ int4 matrix products for CPU decode steps: y [M, N] = x [M, K] @ w [N, K]^T, w 4-bit with a float32 scale
 * and zero point per output channel and group of G inputs (w = (code - zero) * scale), M <= 64 rows, bf16
 * activations.
 *
 * A decode step is bound by reading the weights; int4 codes are a quarter of bf16's bytes, so the kernel must
 * widen them for almost nothing. A code c becomes the bf16 number 128 + c by OR-ing it into 0x4300 (128.0: its 7
 * mantissa bits count units), one logic operation per 32 codes and exact. The products then sum (128 + c) x over a
 * group; per group and row, with X = the sum of x over the group (computed once per call and shared by every
 * channel), y += scale * (that sum) + bias * X where bias = -(zero + 128) * scale: the group's scale and zero point
 * are applied once per 16 channels and group, in float32, not per weight.
 *
 * Layout (made once at load, kernels/cpu_gemm_awq.py): codes uint8 [N/16, K/4, 32]: per block of 16 channels and
 * 4 inputs 4q..4q+3, byte 2i + t holds channel i's input 4q + t in its low nibble and 4q + 2 + t in its high one.
 * Zero-extended to 32 words, the low nibbles are then 16 channels x the input pair (4q, 4q+1) and the high ones
 * the pair (4q+2, 4q+3): the layout of the B operand of AMX's TDPBF16PS and of a broadcast-activation VDPBF16PS
 * (lanes = channels). Scales float32 [N/16, K/G, 2, 16]: per channel block and group, the 16 scales, then the 16
 * biases.
 *
 * Up to DOT_ROWS rows: AVX-512 BF16 dot products, each activation pair broadcast against 16 channels (no
 * horizontal sums). More rows: the activations (row-major as they come, zero-padded to 16 rows) are AMX's A
 * operand and the widened weights its B, so an accumulator tile is y's 16 rows x 16 channels of one group, stored
 * and scaled per group (up to 16 rows the rows' float32 sums stay in registers between groups). Threads (OpenMP)
 * take the channel blocks in pairs as they come free.
 *
 * Requirements (the caller checks): K % 32 == 0, G % 32 == 0 and K % G == 0, N % 16 == 0, 1 <= M <= 64,
 * everything contiguous.
 */
#include <stdlib.h>

#include <omp.h>

#include "amx_tiles.h"
#include "stripes.h"

#define MAX_ROWS 64
#define DOT_ROWS 2    /* rows up to which broadcast dot products beat tiles (measured: 2 rows 8.8 vs 10.0 ms a
                       * pass, 3 rows 11.5 vs 10.5, 4 rows 14.1 vs 10.7) */
#define GROUP_ROWS 16 /* activation rows per accumulator tile */
#define BLOCK_N 16    /* output channels per block (one tile's columns, one vector's lanes) */
#define BLOCK_K 32    /* inputs per tile product */

/* Codes are read this many bytes ahead into L2 (the hardware prefetcher alone left the one-row pass at half the
 * memory rate bf16 weights stream at). */
#ifndef PREFETCH_AHEAD
#define PREFETCH_AHEAD 4096
#endif


/* 1 when the kernel can run in this process (Linux hands out AMX state on request), else 0. */
int awq_gemm_init(void) {
#if HAVE_AMX
    return amx_request_permission();
#else
    return 0;
#endif
}

#if HAVE_AMX

/* 16 channels x 4 inputs (32 bytes of codes) as bf16 128 + code: the input pair (4q, 4q+1) in *low, (4q+2, 4q+3)
 * in *high. */
static inline void widen_chunk(const uint8_t *codes, __m512i *low, __m512i *high) {
    const __m512i words = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)codes));
    const __m512i nibble = _mm512_set1_epi16(0x000F), base = _mm512_set1_epi16(0x4300);
    *low = _mm512_ternarylogic_epi32(words, nibble, base, 0xEA); /* (words & nibble) | base */
    *high = _mm512_or_si512(_mm512_srli_epi16(words, 4), base);
}

/* sums[m][g] = the float32 sum of x[m] over group g. */
static void group_sums(const uint16_t *x, float *sums, int64_t M, int64_t K, int64_t G) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / G; g++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t k = g * G; k < (g + 1) * G; k += 16) {
                const __m256i h = _mm256_loadu_si256((const __m256i *)(x + m * K + k));
                acc = _mm512_add_ps(acc, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
            }
            sums[m * (K / G) + g] = _mm512_reduce_add_ps(acc);
        }
}

/* y rows (float32, 16 channels each) to bf16 out. */
static inline void store_rows(const __m512 *y, uint16_t *out, int64_t M, int64_t N) {
    for (int64_t m = 0; m < M; m++)
        _mm256_storeu_si256((__m256i *)(out + m * N), (__m256i)_mm512_cvtneps_pbh(y[m]));
}

/* Channels n0 .. n0 + 15 of every row (M <= DOT_ROWS, a constant where inlined, so that the accumulators stay in
 * registers) by broadcast dot products, four independent accumulators per row (two chunks at a time). */
static inline __attribute__((always_inline)) void dot_block(const uint32_t *xp, const uint8_t *codes,
                                                            const float *scales, const float *sums, uint16_t *out,
                                                            const int64_t M, int64_t N, int64_t K, int64_t G) {
    const int64_t groups = K / G, pairs = K / 2;
    __m512 y[DOT_ROWS];
    for (int m = 0; m < M; m++)
        y[m] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++) {
        __m512 a[DOT_ROWS][4];
        for (int m = 0; m < M; m++)
            a[m][0] = a[m][1] = a[m][2] = a[m][3] = _mm512_setzero_ps();
        for (int64_t q = g * G / 4; q < (g + 1) * G / 4; q += 2) {
            __m512i low0, high0, low1, high1;
            _mm_prefetch((const char *)(codes + q * 32 + PREFETCH_AHEAD), _MM_HINT_T1);
            widen_chunk(codes + q * 32, &low0, &high0);
            widen_chunk(codes + q * 32 + 32, &low1, &high1);
            for (int m = 0; m < M; m++) {
                const uint32_t *xm = xp + m * pairs + 2 * q;
                a[m][0] = _mm512_dpbf16_ps(a[m][0], (__m512bh)low0, (__m512bh)_mm512_set1_epi32((int)xm[0]));
                a[m][1] = _mm512_dpbf16_ps(a[m][1], (__m512bh)high0, (__m512bh)_mm512_set1_epi32((int)xm[1]));
                a[m][2] = _mm512_dpbf16_ps(a[m][2], (__m512bh)low1, (__m512bh)_mm512_set1_epi32((int)xm[2]));
                a[m][3] = _mm512_dpbf16_ps(a[m][3], (__m512bh)high1, (__m512bh)_mm512_set1_epi32((int)xm[3]));
            }
        }
        _mm_prefetch((const char *)(scales + g * 32 + PREFETCH_AHEAD / 4), _MM_HINT_T1);
        _mm_prefetch((const char *)(scales + g * 32 + 16 + PREFETCH_AHEAD / 4), _MM_HINT_T1);
        const __m512 scale = _mm512_loadu_ps(scales + g * 32), bias = _mm512_loadu_ps(scales + g * 32 + 16);
        for (int m = 0; m < M; m++) {
            const __m512 sum = _mm512_add_ps(_mm512_add_ps(a[m][0], a[m][1]), _mm512_add_ps(a[m][2], a[m][3]));
            y[m] = _mm512_fmadd_ps(sum, scale, y[m]);
            y[m] = _mm512_fmadd_ps(bias, _mm512_set1_ps(sums[m * groups + g]), y[m]);
        }
    }
    store_rows(y, out, M, N);
}

/* dot_block with the row count a constant. */
static void dot_rows(const uint32_t *xp, const uint8_t *codes, const float *scales, const float *sums,
                     uint16_t *out, int64_t M, int64_t N, int64_t K, int64_t G) {
    switch (M) {
    case 1: dot_block(xp, codes, scales, sums, out, 1, N, K, G); break;
    default: dot_block(xp, codes, scales, sums, out, 2, N, K, G); break;
    }
}

/* y[16 rg + r] += scale * acc[r] + bias * sums[row][g] for the rows of row group rg (acc: one stored tile). */
static inline void scale_tile(const float *acc, __m512 scale, __m512 bias, const float *sums, float *y, int64_t rg,
                              int64_t M, int64_t groups, int64_t g) {
    for (int64_t r = 0; r < GROUP_ROWS && 16 * rg + r < M; r++) {
        const int64_t m = 16 * rg + r;
        __m512 v = _mm512_fmadd_ps(_mm512_load_ps(acc + 16 * r), scale, _mm512_load_ps(y + 16 * m));
        v = _mm512_fmadd_ps(bias, _mm512_set1_ps(sums[m * groups + g]), v);
        _mm512_store_ps(y + 16 * m, v);
    }
}

/* Group g's codes of a 16-channel block (G inputs) widened into `wide` (G/2 pair rows x 16 channels), the tiles'
 * weight operand. A group at a time, just before its products, into one of two 2-4 KiB slices: widening the whole
 * block first (K = 1536: 48 KiB) beside the activations' rows pushed both out of L1 (the down projection took 73 %
 * of the time of gate/up, which has twice its weights). */
static inline uint32_t *widen_group(const uint8_t *codes, int64_t g, int64_t G, uint32_t *wide) {
    uint32_t *slice = wide + (g % 2) * (G / 2) * 16;
    for (int64_t q = g * G / 4; q < (g + 1) * G / 4; q++) {
        __m512i low, high;
        if (q % 2 == 0)
            _mm_prefetch((const char *)(codes + q * 32 + PREFETCH_AHEAD), _MM_HINT_T1);
        widen_chunk(codes + q * 32, &low, &high);
        const int64_t row = 2 * (q - g * G / 4);
        _mm512_store_si512(slice + row * 16, low);
        _mm512_store_si512(slice + (row + 1) * 16, high);
    }
    return slice;
}

/* Channels n0 .. n0 + 15 of every row on tiles: per group, its codes widened into a slice of `wide` (G/2 pair
 * rows x 16 channels), one accumulator per row group (tiles 0-3), activations tiles 4-5, weights tile 6. */
static void tile_block(const uint16_t *xpad, const uint8_t *codes, const float *scales, const float *sums,
                       uint16_t *out, int64_t M, int64_t N, int64_t K, int64_t G, uint32_t *wide, float *acc,
                       float *y) {
    const int64_t groups = K / G, row_groups = (M + GROUP_ROWS - 1) / GROUP_ROWS, stride = K * 2;
    memset(y, 0, (size_t)M * 16 * sizeof(float));
    for (int64_t g = 0; g < groups; g++) {
        const uint32_t *slice = widen_group(codes, g, G, wide);
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t kb = g * G / BLOCK_K; kb < (g + 1) * G / BLOCK_K; kb++) {
            const uint16_t *a = xpad + kb * BLOCK_K;
            _tile_loadd(6, slice + (kb - g * G / BLOCK_K) * 16 * 16, 64);
            _tile_loadd(4, a, stride);
            _tile_dpbf16ps(0, 4, 6);
            if (row_groups > 1) {
                _tile_loadd(5, a + 16 * K, stride);
                _tile_dpbf16ps(1, 5, 6);
            }
            if (row_groups > 2) {
                _tile_loadd(4, a + 32 * K, stride);
                _tile_dpbf16ps(2, 4, 6);
            }
            if (row_groups > 3) {
                _tile_loadd(5, a + 48 * K, stride);
                _tile_dpbf16ps(3, 5, 6);
            }
        }
        const __m512 scale = _mm512_loadu_ps(scales + g * 32), bias = _mm512_loadu_ps(scales + g * 32 + 16);
        for (int64_t rg = 0; rg < row_groups; rg++) {
            switch (rg) {
            case 0: _tile_stored(0, acc, 64); break;
            case 1: _tile_stored(1, acc, 64); break;
            case 2: _tile_stored(2, acc, 64); break;
            default: _tile_stored(3, acc, 64); break;
            }
            scale_tile(acc, scale, bias, sums, y, rg, M, groups, g);
        }
    }
    for (int64_t m = 0; m < M; m++)
        _mm256_storeu_si256((__m256i *)(out + m * N), (__m256i)_mm512_cvtneps_pbh(_mm512_load_ps(y + 16 * m)));
}

/* The tile products of group g into accumulator tile T (activations tile A, weights tile B), stored to acc, then
 * scaled into the 16 rows y (registers). */
#define ONE_GROUP(T, A, B, g)                                                                                       \
    do {                                                                                                            \
        const uint32_t *slice = widen_group(codes, (g), G, wide);                                                  \
        _tile_zero(T);                                                                                              \
        for (int64_t kb = (g) * G / BLOCK_K; kb < ((g) + 1) * G / BLOCK_K; kb++) {                                  \
            _tile_loadd(B, slice + (kb - (g) * G / BLOCK_K) * 16 * 16, 64);                                         \
            _tile_loadd(A, xpad + kb * BLOCK_K, stride);                                                            \
            _tile_dpbf16ps(T, A, B);                                                                                \
        }                                                                                                           \
        _tile_stored(T, acc, 64);                                                                                   \
        const __m512 scale = _mm512_loadu_ps(scales + (g) * 32), bias = _mm512_loadu_ps(scales + (g) * 32 + 16);   \
        for (int r = 0; r < R; r++) {                                                                               \
            y[r] = _mm512_fmadd_ps(_mm512_load_ps(acc + 16 * r), scale, y[r]);                                      \
            y[r] = _mm512_fmadd_ps(bias, _mm512_set1_ps(sums[r * groups + (g)]), y[r]);                             \
        }                                                                                                           \
    } while (0)

/* tile_block for at most R <= 16 rows (one row group; `sums` has R rows, zeros past M; the tile reads 16, zeros
 * past M too): the rows' float32 sums stay in registers between groups instead of going through memory (at 16 rows,
 * scaling each group's tile costs as much as its products). R is a constant where inlined (8 or 16). */
static inline __attribute__((always_inline)) void tile_block_regs(const uint16_t *xpad, const uint8_t *codes,
                                                                  const float *scales, const float *sums,
                                                                  uint16_t *out, int64_t M, int64_t N, int64_t K,
                                                                  int64_t G, uint32_t *wide, float *acc, const int R) {
    const int64_t groups = K / G, stride = K * 2;
    __m512 y[GROUP_ROWS];
    for (int r = 0; r < R; r++)
        y[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g++)
        ONE_GROUP(0, 4, 6, g);
    for (int64_t m = 0; m < M; m++)
        _mm256_storeu_si256((__m256i *)(out + m * N), (__m256i)_mm512_cvtneps_pbh(y[m]));
}

/* Rows a tile_block_regs call keeps in registers for M rows (0: more than one row group, tile_block's). */
static inline int register_rows(int64_t M) {
    return M <= GROUP_ROWS / 2 ? GROUP_ROWS / 2 : M <= GROUP_ROWS ? GROUP_ROWS : 0;
}

/* This thread's buffer of at least `bytes` (kept between calls), or NULL. */
static void *thread_buffer(void **buffer, size_t *capacity, size_t bytes) {
    if (bytes > *capacity) {
        free(*buffer);
        *buffer = aligned_alloc(64, (bytes + 63) / 64 * 64);
        *capacity = *buffer ? bytes : 0;
    }
    return *buffer;
}

static __thread void *wide_buffer, *pad_buffer, *sum_buffer;
static __thread size_t wide_capacity, pad_capacity, sum_capacity;

#endif /* HAVE_AMX */

/* y = x @ w^T for AWQ int4 weights in this kernel's layout. Returns 0 when done, -1 when this build or these
 * shapes cannot (the caller then uses torch). */
int awq_gemm(const uint16_t *x, const uint8_t *codes, const float *scales, uint16_t *out, int64_t M, int64_t N,
             int64_t K, int64_t G, int num_threads) {
#if HAVE_AMX
    if (M < 1 || M > MAX_ROWS || N <= 0 || N % BLOCK_N || K <= 0 || K % BLOCK_K || G <= 0 || G % BLOCK_K || K % G)
        return -1;
    const int64_t blocks = N / BLOCK_N, groups = K / G, rows = (M + GROUP_ROWS - 1) / GROUP_ROWS * GROUP_ROWS;
    const int64_t sum_rows = M > DOT_ROWS && register_rows(M) > M ? register_rows(M) : M; /* zero rows read */
    float *sums = thread_buffer(&sum_buffer, &sum_capacity, (size_t)sum_rows * groups * sizeof(float));
    if (!sums)
        return -1;
    group_sums(x, sums, M, K, G);
    memset(sums + M * groups, 0, (size_t)(sum_rows - M) * groups * sizeof(float));
    const uint16_t *xpad = x;
    if (M > DOT_ROWS && M < rows) { /* the tiles read whole groups of 16 rows: zeros past M */
        uint16_t *pad = thread_buffer(&pad_buffer, &pad_capacity, (size_t)rows * K * sizeof(uint16_t));
        if (!pad)
            return -1;
        memcpy(pad, x, (size_t)M * K * sizeof(uint16_t));
        memset(pad + M * K, 0, (size_t)(rows - M) * K * sizeof(uint16_t));
        xpad = pad;
    }
    const int64_t stripes = (blocks + 1) / 2; /* two blocks each */
    num_threads = team_size(num_threads, stripes);
    StripeRun runs[MAX_STRIPE_THREADS];
    stripe_runs_init(runs, stripes, num_threads);
    int failed = 0;
#pragma omp parallel num_threads(num_threads) reduction(| : failed)
    {
        uint32_t *wide = NULL;
        float *y = NULL;
        _Alignas(64) float acc[16 * 16];
        if (M > DOT_ROWS) {
            wide = thread_buffer(&wide_buffer, &wide_capacity, (size_t)K * 32 + (size_t)MAX_ROWS * 16 * 4);
            y = wide ? (float *)((uint8_t *)wide + K * 32) : NULL;
            failed = !wide;
            configure_tiles();
        }
        /* Each thread its own run of block pairs, then pairs from the back of another's (stripes.h): the codes
         * PREFETCH_AHEAD bytes on are then mostly its own next ones, and a thread descheduled mid-call on cores
         * shared with the engine's threads holds back one pair. */
        int64_t pair, next;
        while ((pair = stripe_take(runs, num_threads, omp_get_thread_num(), &next)) >= 0) {
            for (int64_t b = 2 * pair; b < 2 * pair + 2 && b < blocks; b++) {
                const uint8_t *block_codes = codes + b * (K / 4) * 32;
                const float *block_scales = scales + b * groups * 32;
                uint16_t *block_out = out + b * BLOCK_N;
                if (M <= DOT_ROWS)
                    dot_rows((const uint32_t *)x, block_codes, block_scales, sums, block_out, M, N, K, G);
                else if (!failed && register_rows(M) == GROUP_ROWS / 2)
                    tile_block_regs(xpad, block_codes, block_scales, sums, block_out, M, N, K, G, wide, acc, 8);
                else if (!failed && register_rows(M) == GROUP_ROWS)
                    tile_block_regs(xpad, block_codes, block_scales, sums, block_out, M, N, K, G, wide, acc, 16);
                else if (!failed)
                    tile_block(xpad, block_codes, block_scales, sums, block_out, M, N, K, G, wide, acc, y);
            }
        }
        if (M > DOT_ROWS)
            _tile_release();
    }
    return failed ? -1 : 0;
#else
    (void)x, (void)codes, (void)scales, (void)out, (void)M, (void)N, (void)K, (void)G, (void)num_threads;
    return -1;
#endif
}
