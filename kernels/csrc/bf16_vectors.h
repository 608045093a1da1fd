/* AVX-512 helpers for bf16 rows and the MLP's activation, shared by the kernels of kernels/csrc that include it
 * (skinny_gemm_cpu.c, glue_cpu.c); empty where the build has no AVX-512 BF16. */
#ifndef MINIVLLM_BF16_VECTORS_H
#define MINIVLLM_BF16_VECTORS_H

#include <stdint.h>

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* 16 bf16 values widened to float32 (exact: a bf16 is a float32's upper half). */
static inline __m512 bf16x16_to_float(const uint16_t *x) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)x)), 16));
}

/* 16 float32 values rounded to bf16 (nearest even; VCVTNEPS2BF16 also quiets a NaN and flushes subnormals). */
static inline void float_to_bf16x16(uint16_t *x, __m512 v) {
    _mm256_storeu_si256((__m256i *)x, (__m256i)_mm512_cvtneps_pbh(v));
}

/* e^x for 16 floats: 2^n * 2^f with n = round(x log2 e), f in [-1/2, 1/2] by a degree-7 polynomial (relative
 * error about 1e-8, below float32's own rounding). */
static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-88.0f));
    const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 f = _mm512_sub_ps(t, n);
    static const float c[] = {1.0f, 0.693147181f, 0.240226507f, 0.0555041087f, 0.00961812911f, 0.00133335581f,
                              0.000154035304f, 1.52527338e-5f};
    __m512 p = _mm512_set1_ps(c[7]);
    for (int i = 6; i >= 0; i--)
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
    return _mm512_scalef_ps(p, n);
}

/* silu(gate) * up for 16 pairs, in float32. */
static inline __m512 silu_mul16(__m512 gate, __m512 up) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), gate));
    return _mm512_mul_ps(_mm512_div_ps(gate, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), up);
}

#endif /* __AVX512BF16__ */
#endif
