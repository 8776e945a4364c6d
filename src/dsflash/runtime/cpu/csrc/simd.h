/* The x86 class a kernel file was compiled for (-march=native, or the flags a test forces): AVX-512 paths test
 * __AVX512F__ themselves; DSF_AVX2 marks the AVX2 + FMA + F16C paths of CPUs without AVX-512 (Zen 2/3, Haswell to
 * Ice Lake clients), where the portable loops ran 20-40x below the memory bandwidth. */
#ifndef DSF_SIMD_H
#define DSF_SIMD_H
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define DSF_AVX2 1
#include <immintrin.h>

/* lanes 0..7 summed as (0 + 4) + (2 + 6) + (1 + 5) + (3 + 7): one fixed order */
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* 16 fp32 -> their top halves (bfloat16 bits, exact where the low halves are zero) at out */
static inline void store_bf16x16(uint16_t *out, __m256 lo, __m256 hi) {
    const __m256i a = _mm256_srli_epi32(_mm256_castps_si256(lo), 16), b = _mm256_srli_epi32(_mm256_castps_si256(hi), 16);
    /* packus works per 128-bit lane: a0-3 b0-3 a4-7 b4-7, put back in order */
    _mm256_storeu_si256((__m256i *)out, _mm256_permute4x64_epi64(_mm256_packus_epi32(a, b), 0xD8));
}
#endif
#endif
