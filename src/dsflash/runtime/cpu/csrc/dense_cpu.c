/* CPU GEMV kernels for the engine's dense weights, fp32 in and out so that tensor-parallel partial sums are
 * exact fp32 products (a TP-4 run then equals a TP-1 run to float32 noise):
 *   fp8_gemv:  W is FP8 E4M3 [O, I] with one power-of-two fp32 scale per (B x B) block (the checkpoint's layout),
 *   bf16_gemv: W is bfloat16 [O, I].
 * y[k, o] = sum_i W[o, i] x[k, i] for rows [r0, r1); x [nx, I], y [nx, O]. Built like bfp_cpu.c. */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_ELEMENTS (1 << 18) /* smaller matrices run on one thread */
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "simd.h"

/* E4M3 byte -> fp32, exact. */
static inline float e4m3_scalar(uint8_t b) {
    int e = (b >> 3) & 15, m = b & 7;
    float v = e ? (1.0f + m / 8.0f) * (float)(1 << e) / 128.0f : m / 512.0f;
    return (b & 128) ? -v : v;
}

static inline float bf16_scalar(uint16_t h) {
    uint32_t b = (uint32_t)h << 16;
    float v;
    memcpy(&v, &b, 4);
    return v;
}

#ifdef __AVX512F__
/* 32 E4M3 bytes -> two vectors of 16 fp32 times 2^-8: the 7 magnitude bits placed in an fp16 keep the 3-bit
 * mantissa and shift the exponent bias from 7 to 15, subnormals included; the 2^8 goes into the block scale. */
static inline void e4m3x32(const uint8_t *p, __m512 *lo, __m512 *hi) {
    /* sign-extended to 16 bits, shifted left by 7: the magnitude at bits 7-13 and the sign at 14 and 15 */
    __m512i h = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)p));
    __m512i f16 = _mm512_and_si512(_mm512_slli_epi16(h, 7), _mm512_set1_epi16((short)0xBFFF));
    *lo = _mm512_cvtph_ps(_mm512_castsi512_si256(f16));
    *hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(f16, 1));
}
#endif

#ifdef __AVX512F__
/* e4m3x32 with the block scale applied (exact: a power of two times at most 4 significant bits) */
static inline void e4m3x32_scaled(const uint8_t *p, __m512 s, __m512 *lo, __m512 *hi) {
    e4m3x32(p, lo, hi);
    *lo = _mm512_mul_ps(*lo, s);
    *hi = _mm512_mul_ps(*hi, s);
}
#endif

#ifdef __AVX512F__
/* Decode (one vector x): R rows at once share each load of x and give the memory system R streams to fetch.
 * The R rows of a group lie in one row of scale blocks, so a column block's scale multiplies x once for all of them
 * (a power of two: every product is exact as before, only the order of the sums differs from per-block partial
 * sums, which cost an add and an FMA per row and block: 22.5 -> 31 GB/s on 2 cores, compute-bound before). Every row
 * goes through the same sequence whatever R, so a row's result never depends on how rows were split. */
#define FP8_ROWS 8 /* rows in flight: 4 -> 8 took the decode from 17.5 to 23 GB/s on 2 cores (memory parallelism) */
static inline __attribute__((always_inline)) void fp8_rows1(const uint8_t *w, int I, const float *sr, int B,
                                                             const float *x, float *y, const int R) {
    __m512 a0[FP8_ROWS], a1[FP8_ROWS];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    for (int j = 0, c = 0; c < I; j++) {
        const __m512 s = _mm512_set1_ps(sr[j]);
        /* the next group's rows at this block: their streams start before this group's end (narrow matrices,
         * 1280-column rows: 15.5 -> 20.5 GB/s; 5120 columns: 27 -> 31) */
        for (int r = 0; r < R; r++) {
            const char *next = (const char *)(w + (size_t)(R + r) * I + c);
            for (int l = 0; l < B; l += 64) _mm_prefetch(next + l, _MM_HINT_T0);
        }
        for (int end = c + B; c < end; c += 32) {
            const __m512 x0 = _mm512_mul_ps(_mm512_loadu_ps(x + c), s);
            const __m512 x1 = _mm512_mul_ps(_mm512_loadu_ps(x + c + 16), s);
            for (int r = 0; r < R; r++) {
                __m512 lo, hi;
                e4m3x32(w + (size_t)r * I + c, &lo, &hi);
                a0[r] = _mm512_fmadd_ps(lo, x0, a0[r]);
                a1[r] = _mm512_fmadd_ps(hi, x1, a1[r]);
            }
        }
    }
    for (int r = 0; r < R; r++) y[r] = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
}
#endif

#ifdef DSF_AVX2
/* e4m3x32's conversion for 16 bytes into two vectors of 8 (the same fp16 trick, the same 2^-8) */
static inline void e4m3x16(const uint8_t *p, __m256 *lo, __m256 *hi) {
    const __m256i h = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)p));
    const __m256i f16 = _mm256_and_si256(_mm256_slli_epi16(h, 7), _mm256_set1_epi16((short)0xBFFF));
    *lo = _mm256_cvtph_ps(_mm256_castsi256_si128(f16));
    *hi = _mm256_cvtph_ps(_mm256_extracti128_si256(f16, 1));
}

/* fp8_rows1 with one accumulator a row (16 registers): eight independent FMA chains keep the units busy and eight
 * rows in flight keep the memory system busy, as on AVX-512 */
#define FP8_ROWS 8
static inline __attribute__((always_inline)) void fp8_rows1(const uint8_t *w, int I, const float *sr, int B,
                                                             const float *x, float *y, const int R) {
    __m256 a[FP8_ROWS];
    for (int r = 0; r < R; r++) a[r] = _mm256_setzero_ps();
    for (int j = 0, c = 0; c < I; j++) {
        const __m256 s = _mm256_set1_ps(sr[j]);
        for (int r = 0; r < R; r++) {
            const char *next = (const char *)(w + (size_t)(R + r) * I + c);
            for (int l = 0; l < B; l += 64) _mm_prefetch(next + l, _MM_HINT_T0);
        }
        for (int end = c + B; c < end; c += 16) {
            const __m256 x0 = _mm256_mul_ps(_mm256_loadu_ps(x + c), s);
            const __m256 x1 = _mm256_mul_ps(_mm256_loadu_ps(x + c + 8), s);
            for (int r = 0; r < R; r++) {
                __m256 lo, hi;
                e4m3x16(w + (size_t)r * I + c, &lo, &hi);
                a[r] = _mm256_fmadd_ps(hi, x1, _mm256_fmadd_ps(lo, x0, a[r]));
            }
        }
    }
    for (int r = 0; r < R; r++) y[r] = hsum8(a[r]);
}
#endif

#if defined(__AVX512F__) || defined(DSF_AVX2)
#ifdef __AVX512F__
#define FP8_LANES 32 /* columns one step of fp8_rows1 reads: the vector loops need B a multiple of it */
#else
#define FP8_LANES 16
#endif
#define FP8_VECTOR 1
/* rows [o, o + 8) (fewer at r1) of an FP8 matrix against x into yo[0..8), as fp8_gemv1 computes them */
static inline void fp8_group(const uint8_t *w, const float *scale, int I, int B, int o, int r1, const float *x,
                             float *yo) {
    const int nbc = I / B;
    if (o + FP8_ROWS <= r1 && (o + FP8_ROWS - 1) / B == o / B)
        fp8_rows1(w + (size_t)o * I, I, scale + (size_t)(o / B) * nbc, B, x, yo, FP8_ROWS);
    else
        for (int k = o; k < r1 && k < o + FP8_ROWS; k++)
            fp8_rows1(w + (size_t)k * I, I, scale + (size_t)(k / B) * nbc, B, x, yo + (k - o), 1);
}

static void fp8_gemv1(const uint8_t *w, const float *scale, int O, int I, int B, const float *x, float *y, int r0,
                      int r1) {
    const int groups = (r1 - r0 + FP8_ROWS - 1) / FP8_ROWS;
    (void)O;
#pragma omp parallel for schedule(static) if ((size_t)(r1 - r0) * I > PARALLEL_ELEMENTS)
    for (int g = 0; g < groups; g++) fp8_group(w, scale, I, B, r0 + FP8_ROWS * g, r1, x, y + r0 + FP8_ROWS * g);
}
#endif

#ifdef DSF_AVX2
#define FP8_VECS 8    /* vectors one decoded row serves at once: their accumulators and the row's halves fit */
#define FP8_UNIT 32   /* rows a thread takes at a time (within one scale block where B is a multiple of 32) */
#define FP8_XS 4096   /* floats of scaled vectors per column tile: 16 KB, which stays in L1 beside the rows */
/* one row's tile of tl columns against K scaled vectors (xs, K x T), accumulators in ao (K x 8) */
static inline __attribute__((always_inline)) void fp8_tile(const uint8_t *row, const uint8_t *next, int tl,
                                                           const float *xs, int T, float *ao, const int K) {
    __m256 a[FP8_VECS];
    for (int k = 0; k < K; k++) a[k] = _mm256_load_ps(ao + 8 * k);
    for (int c = 0; c < tl; c += 16) {
        if ((c & 63) == 0) _mm_prefetch((const char *)(next + c), _MM_HINT_T0);
        __m256 lo, hi;
        e4m3x16(row + c, &lo, &hi);
        for (int k = 0; k < K; k++)
            a[k] = _mm256_fmadd_ps(hi, _mm256_load_ps(xs + k * T + c + 8), _mm256_fmadd_ps(lo, _mm256_load_ps(xs + k * T + c), a[k]));
    }
    for (int k = 0; k < K; k++) _mm256_store_ps(ao + 8 * k, a[k]);
}

/* fp8_tile for R rows at once (stride I, accumulators 8 K apart in ao): R memory streams where a few vectors leave
 * registers for them; every output's chain is fp8_tile's */
static inline __attribute__((always_inline)) void fp8_tile_rows(const uint8_t *row, size_t I, const uint8_t *next,
                                                                int tl, const float *xs, int T, float *ao,
                                                                const int K, const int R) {
    __m256 a[4][4];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < K; k++) a[r][k] = _mm256_load_ps(ao + 8 * (r * K + k));
    for (int c = 0; c < tl; c += 16) {
        if ((c & 63) == 0)
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(next + r * I + c), _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            __m256 lo, hi;
            e4m3x16(row + r * I + c, &lo, &hi);
            for (int k = 0; k < K; k++)
                a[r][k] = _mm256_fmadd_ps(hi, _mm256_load_ps(xs + k * T + c + 8),
                                          _mm256_fmadd_ps(lo, _mm256_load_ps(xs + k * T + c), a[r][k]));
        }
    }
    for (int r = 0; r < R; r++)
        for (int k = 0; k < K; k++) _mm256_store_ps(ao + 8 * (r * K + k), a[r][k]);
}

/* nx > 1 vectors (a batched decode step's rows): each weight row is decoded once for up to FP8_VECS vectors.
 * Every output is fp8_rows1's chain (x times the block scale, then the same FMAs
 * in column order, then hsum8), so row k of a batch equals the one-vector call on x[k] bit for bit. Columns go in
 * tiles whose scaled vectors stay in L1 for a unit of rows; the rows' accumulators wait in memory between tiles
 * (stored and reloaded whole: the bits do not change). */
static void fp8_gemv_vecs(const uint8_t *w, const float *scale, int O, int I, int B, const float *x, int nx, float *y,
                          int r0, int r1) {
    const int nbc = I / B, unit = B % FP8_UNIT == 0 ? FP8_UNIT : B;
    const int u0 = r0 / unit, u1 = (r1 + unit - 1) / unit;
    (void)O;
#pragma omp parallel if ((size_t)(r1 - r0) * I * nx > PARALLEL_ELEMENTS)
    {
        float xs[FP8_XS] __attribute__((aligned(32))); /* on each thread's stack: nothing to allocate or free */
        float am[8 * FP8_VECS * unit] __attribute__((aligned(32)));
        for (int k0 = 0; k0 < nx; k0 += FP8_VECS) {
            const int K = nx - k0 < FP8_VECS ? nx - k0 : FP8_VECS;
            const int T = (FP8_XS / K) & ~15;
#pragma omp for schedule(static)
            for (int u = u0; u < u1; u++) {
                const int o0 = u * unit > r0 ? u * unit : r0, o1 = (u + 1) * unit < r1 ? (u + 1) * unit : r1;
                const float *sr = scale + (size_t)(o0 / B) * nbc;
                memset(am, 0, sizeof(float) * 8 * K * (size_t)(o1 - o0));
                for (int t = 0; t < I; t += T) {
                    const int tl = I - t < T ? I - t : T;
                    for (int k = 0; k < K; k++)
                        for (int c = 0; c < tl; c += 8)
                            _mm256_store_ps(xs + k * T + c, _mm256_mul_ps(_mm256_loadu_ps(x + (size_t)(k0 + k) * I + t + c),
                                                                          _mm256_set1_ps(sr[(t + c) / B])));
                    /* two to four vectors: rows two or four at a time (more memory streams) */
                    const int R = K <= 2 ? 4 : (K <= 4 ? 2 : 1);
                    int o = o0;
                    for (; R > 1 && o + R <= o1; o += R) {
                        const uint8_t *row = w + (size_t)o * I + t, *next = row + (o + 2 * R <= o1 ? (size_t)R * I : 0);
                        float *ao = am + (size_t)(o - o0) * 8 * K;
                        if (K == 1)
                            fp8_tile_rows(row, I, next, tl, xs, T, ao, 1, 4);
                        else if (K == 2)
                            fp8_tile_rows(row, I, next, tl, xs, T, ao, 2, 4);
                        else if (K == 3)
                            fp8_tile_rows(row, I, next, tl, xs, T, ao, 3, 2);
                        else
                            fp8_tile_rows(row, I, next, tl, xs, T, ao, 4, 2);
                    }
                    for (; o < o1; o++) {
                        const uint8_t *row = w + (size_t)o * I + t, *next = row + (o + 4 < o1 ? 4 * I : 0);
                        float *ao = am + (size_t)(o - o0) * 8 * K;
                        switch (K) { /* constant K: the accumulators stay in registers */
                        case 1: fp8_tile(row, next, tl, xs, T, ao, 1); break;
                        case 2: fp8_tile(row, next, tl, xs, T, ao, 2); break;
                        case 3: fp8_tile(row, next, tl, xs, T, ao, 3); break;
                        case 4: fp8_tile(row, next, tl, xs, T, ao, 4); break;
                        case 5: fp8_tile(row, next, tl, xs, T, ao, 5); break;
                        case 6: fp8_tile(row, next, tl, xs, T, ao, 6); break;
                        case 7: fp8_tile(row, next, tl, xs, T, ao, 7); break;
                        default: fp8_tile(row, next, tl, xs, T, ao, 8); break;
                        }
                    }
                }
                for (int o = o0; o < o1; o++)
                    for (int k = 0; k < K; k++)
                        y[(size_t)(k0 + k) * O + o] = hsum8(_mm256_load_ps(am + (size_t)(o - o0) * 8 * K + 8 * k));
            }
        }
    }
}
#endif

#ifdef __AVX512F__
#define FP8_VECS 8    /* vectors one decoded row serves at once: 16 accumulators, the row's halves, x */
#define FP8_UNIT 32   /* rows a thread takes at a time (within one scale block where B is a multiple of 32) */
#define FP8_XS 4096   /* floats of scaled vectors per column tile: 16 KB, which stays in L1 beside the rows */
/* one row's tile of tl columns against K scaled vectors (xs, K x T), two accumulators a vector in ao (K x 32) */
static inline __attribute__((always_inline)) void fp8_tile(const uint8_t *row, const uint8_t *next, int tl,
                                                           const float *xs, int T, float *ao, const int K) {
    __m512 a0[FP8_VECS], a1[FP8_VECS];
    for (int k = 0; k < K; k++) a0[k] = _mm512_load_ps(ao + 32 * k), a1[k] = _mm512_load_ps(ao + 32 * k + 16);
    for (int c = 0; c < tl; c += 32) {
        if ((c & 63) == 0) _mm_prefetch((const char *)(next + c), _MM_HINT_T0);
        __m512 lo, hi;
        e4m3x32(row + c, &lo, &hi);
        for (int k = 0; k < K; k++) {
            a0[k] = _mm512_fmadd_ps(lo, _mm512_load_ps(xs + k * T + c), a0[k]);
            a1[k] = _mm512_fmadd_ps(hi, _mm512_load_ps(xs + k * T + c + 16), a1[k]);
        }
    }
    for (int k = 0; k < K; k++) _mm512_store_ps(ao + 32 * k, a0[k]), _mm512_store_ps(ao + 32 * k + 16, a1[k]);
}

/* fp8_tile for R rows at once (rows R apart at stride I, their accumulators 32 K apart in ao): R memory streams,
 * as fp8_rows1 keeps for one vector, where a few vectors leave registers for them; every output's chain is
 * fp8_tile's */
static inline __attribute__((always_inline)) void fp8_tile_rows(const uint8_t *row, size_t I, const uint8_t *next,
                                                                int tl, const float *xs, int T, float *ao,
                                                                const int K, const int R) {
    __m512 a0[4][4], a1[4][4];
    for (int r = 0; r < R; r++)
        for (int k = 0; k < K; k++)
            a0[r][k] = _mm512_load_ps(ao + 32 * (r * K + k)), a1[r][k] = _mm512_load_ps(ao + 32 * (r * K + k) + 16);
    for (int c = 0; c < tl; c += 32) {
        if ((c & 63) == 0)
            for (int r = 0; r < R; r++) _mm_prefetch((const char *)(next + r * I + c), _MM_HINT_T0);
        for (int r = 0; r < R; r++) {
            __m512 lo, hi;
            e4m3x32(row + r * I + c, &lo, &hi);
            for (int k = 0; k < K; k++) {
                a0[r][k] = _mm512_fmadd_ps(lo, _mm512_load_ps(xs + k * T + c), a0[r][k]);
                a1[r][k] = _mm512_fmadd_ps(hi, _mm512_load_ps(xs + k * T + c + 16), a1[r][k]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int k = 0; k < K; k++)
            _mm512_store_ps(ao + 32 * (r * K + k), a0[r][k]), _mm512_store_ps(ao + 32 * (r * K + k) + 16, a1[r][k]);
}

/* nx > 1 vectors on AVX-512, as the AVX2 loop below: each weight row decoded once for up to FP8_VECS vectors
 * (decoded once per pair, 2 rows cost 2.3x one and 8 rows 5.3x; now 1.4x and 2.8x). Every output is fp8_rows1's chain (x
 * times the block scale, the same two FMA chains in column order, then their sum reduced), so row k of a batch
 * equals the one-vector call on x[k] bit for bit. The caller holds B a multiple of 32, so a unit of 32 rows lies in
 * one row of scale blocks. */
static void fp8_gemv_vecs(const uint8_t *w, const float *scale, int O, int I, int B, const float *x, int nx, float *y,
                          int r0, int r1) {
    const int nbc = I / B, u0 = r0 / FP8_UNIT, u1 = (r1 + FP8_UNIT - 1) / FP8_UNIT;
    (void)O;
#pragma omp parallel if ((size_t)(r1 - r0) * I * nx > PARALLEL_ELEMENTS)
    {
        float xs[FP8_XS] __attribute__((aligned(64))); /* on each thread's stack: nothing to allocate or free */
        float am[32 * FP8_VECS * FP8_UNIT] __attribute__((aligned(64)));
        for (int k0 = 0; k0 < nx; k0 += FP8_VECS) {
            const int K = nx - k0 < FP8_VECS ? nx - k0 : FP8_VECS;
            const int T = (FP8_XS / K) & ~31;
#pragma omp for schedule(static)
            for (int u = u0; u < u1; u++) {
                const int o0 = u * FP8_UNIT > r0 ? u * FP8_UNIT : r0;
                const int o1 = (u + 1) * FP8_UNIT < r1 ? (u + 1) * FP8_UNIT : r1;
                const float *sr = scale + (size_t)(o0 / B) * nbc;
                memset(am, 0, sizeof(float) * 32 * K * (size_t)(o1 - o0));
                for (int t = 0; t < I; t += T) {
                    const int tl = I - t < T ? I - t : T;
                    for (int k = 0; k < K; k++)
                        for (int c = 0; c < tl; c += 16)
                            _mm512_store_ps(xs + k * T + c, _mm512_mul_ps(_mm512_loadu_ps(x + (size_t)(k0 + k) * I + t + c),
                                                                          _mm512_set1_ps(sr[(t + c) / B])));
                    /* two to four vectors: rows two or four at a time (more memory streams, few enough
                     * accumulators for the registers) */
                    const int R = K <= 2 ? 4 : (K <= 4 ? 2 : 1);
                    int o = o0;
                    for (; R > 1 && o + R <= o1; o += R) {
                        const uint8_t *row = w + (size_t)o * I + t, *next = row + (o + 2 * R <= o1 ? (size_t)R * I : 0);
                        float *ao = am + (size_t)(o - o0) * 32 * K;
                        if (K == 1)
                            fp8_tile_rows(row, I, next, tl, xs, T, ao, 1, 4);
                        else if (K == 2)
                            fp8_tile_rows(row, I, next, tl, xs, T, ao, 2, 4);
                        else if (K == 3)
                            fp8_tile_rows(row, I, next, tl, xs, T, ao, 3, 2);
                        else
                            fp8_tile_rows(row, I, next, tl, xs, T, ao, 4, 2);
                    }
                    for (; o < o1; o++) {
                        const uint8_t *row = w + (size_t)o * I + t, *next = row + (o + 4 < o1 ? 4 * I : 0);
                        float *ao = am + (size_t)(o - o0) * 32 * K;
                        switch (K) { /* constant K: the accumulators stay in registers */
                        case 1: fp8_tile(row, next, tl, xs, T, ao, 1); break;
                        case 2: fp8_tile(row, next, tl, xs, T, ao, 2); break;
                        case 3: fp8_tile(row, next, tl, xs, T, ao, 3); break;
                        case 4: fp8_tile(row, next, tl, xs, T, ao, 4); break;
                        case 5: fp8_tile(row, next, tl, xs, T, ao, 5); break;
                        case 6: fp8_tile(row, next, tl, xs, T, ao, 6); break;
                        case 7: fp8_tile(row, next, tl, xs, T, ao, 7); break;
                        default: fp8_tile(row, next, tl, xs, T, ao, 8); break;
                        }
                    }
                }
                for (int o = o0; o < o1; o++)
                    for (int k = 0; k < K; k++) {
                        const float *ao = am + (size_t)(o - o0) * 32 * K + 32 * k;
                        y[(size_t)(k0 + k) * O + o] =
                            _mm512_reduce_add_ps(_mm512_add_ps(_mm512_load_ps(ao), _mm512_load_ps(ao + 16)));
                    }
            }
        }
    }
}
#endif

/* the most rows fp8_gemv beats the fused panel product at in this build (docs/performance.md): both vector builds
 * decode a row once for up to 8 vectors, and AVX-512's panels (twice AVX2's lanes) draw level from ~12 rows */
int fp8_gemv_max_rows(void) {
#ifdef DSF_AVX2
    return 24;
#else
    return 8;
#endif
}

/* fp32 scale per block, pre-multiplied by 2^8 for the vector decode above */
void fp8_gemv(const uint8_t *w, const float *scale, int O, int I, int B, const float *x, int nx, float *y, int r0,
              int r1) {
    const int nbc = (I + B - 1) / B;
#ifdef FP8_VECTOR
    if (B % FP8_LANES == 0 && I % B == 0) {
        if (nx == 1)
            fp8_gemv1(w, scale, O, I, B, x, y, r0, r1);
        else
            fp8_gemv_vecs(w, scale, O, I, B, x, nx, y, r0, r1);
        return;
    }
#endif
#pragma omp parallel for schedule(static) if ((size_t)(r1 - r0) * I > PARALLEL_ELEMENTS)
    for (int o = r0; o < r1; o++) {
        const uint8_t *row = w + (size_t)o * I;
        const float *sr = scale + (size_t)(o / B) * nbc;
        for (int k0 = 0; k0 < nx; k0 += 2) {
            int two = nx - k0 > 1;
            const float *x0 = x + (size_t)k0 * I, *x1 = x0 + (two ? I : 0);
            float acc0 = 0, acc1 = 0;
            for (int c = 0; c < I; c++) {
                float v = e4m3_scalar(row[c]) * sr[c / B] / 256.0f;
                acc0 += v * x0[c];
                acc1 += v * x1[c];
            }
            y[(size_t)k0 * O + o] = acc0;
            if (two) y[(size_t)(k0 + 1) * O + o] = acc1;
        }
    }
}

/* Block-diagonal decode (V4's grouped wo_a): rows [g * per, (g + 1) * per) multiply x + g * I, one vector per
 * group. One parallel region for all groups instead of one call each; every group's rows are split and computed as
 * fp8_gemv(..., g * per, (g + 1) * per) would, so each equals that call bit for bit. */
void fp8_gemv_grouped(const uint8_t *w, const float *scale, int O, int I, int B, const float *x, int per, float *y) {
    const int groups = O / per;
#ifdef FP8_VECTOR
    if (B % FP8_LANES == 0 && I % B == 0) {
        const int units = (per + FP8_ROWS - 1) / FP8_ROWS;
#pragma omp parallel for schedule(static) if ((size_t)O * I > PARALLEL_ELEMENTS)
        for (int u = 0; u < groups * units; u++) {
            const int g = u / units, o = g * per + FP8_ROWS * (u % units);
            fp8_group(w, scale, I, B, o, (g + 1) * per, x + (size_t)g * I, y + o);
        }
        return;
    }
#endif
    for (int g = 0; g < groups; g++) fp8_gemv(w, scale, O, I, B, x + (size_t)g * I, 1, y, g * per, (g + 1) * per);
}

/* A SwiGLU FFN with FP8 weights (the shared expert) for one decode vector in one parallel region:
 *   h = swiglu(W1 x, W3 x) (the clamp as model.experts.swiglu), y = W2 h,
 * W1 and W3 [F, D], W2 [D, F], all with B x B scales (x 256). Each product has fp8_gemv's bits; one barrier
 * between the halves where three kernel calls and the activation's tensor operations went before. h: [F] scratch.
 * Returns 0 where the shapes do not fit the vector loops (the caller multiplies one matrix at a time). */
int fp8_ffn_decode(const uint8_t *w1, const float *s1, const uint8_t *w3, const float *s3, const uint8_t *w2,
                   const float *s2, int F, int D, int B, const float *x, float limit, float *h, float *y) {
#ifdef FP8_VECTOR
    if (B % FP8_LANES || D % B || F % B) return 0;
    const int g13 = (F + FP8_ROWS - 1) / FP8_ROWS, g2 = (D + FP8_ROWS - 1) / FP8_ROWS;
#pragma omp parallel if ((size_t)F * D > PARALLEL_ELEMENTS)
    {
#pragma omp for schedule(static)
        for (int g = 0; g < g13; g++) {
            const int o = FP8_ROWS * g;
            float u[FP8_ROWS];
            fp8_group(w1, s1, D, B, o, F, x, h + o);
            fp8_group(w3, s3, D, B, o, F, x, u);
            for (int k = o; k < F && k < o + FP8_ROWS; k++) {
                float gk = h[k], uk = u[k - o];
                if (limit > 0) { /* comparisons, not fminf: a NaN stays NaN as in torch.clamp */
                    uk = uk < -limit ? -limit : (uk > limit ? limit : uk);
                    gk = gk > limit ? limit : gk;
                }
                h[k] = gk / (1.0f + expf(-gk)) * uk;
            }
        }
#pragma omp for schedule(static)
        for (int g = 0; g < g2; g++) fp8_group(w2, s2, F, B, FP8_ROWS * g, D, h, y + FP8_ROWS * g);
    }
    return 1;
#else
    (void)w1, (void)s1, (void)w3, (void)s3, (void)w2, (void)s2, (void)F, (void)D, (void)B, (void)x, (void)limit;
    (void)h, (void)y;
    return 0;
#endif
}

#ifdef __AVX512F__
static inline __m512 bf16_lo(__m512i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
}
static inline __m512 bf16_hi(__m512i h) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
}

/* Decode: R rows against one vector, as fp8_rows1, the next R rows prefetched as these are read (the 1.3 GB head on
 * huge pages: 47.5 -> 41.8 ms); the columns past the last multiple of 32 go scalar. */
static inline __attribute__((always_inline)) void bf16_rows1(const uint16_t *w, int I, const float *x, float *y,
                                                             const int R) {
    __m512 a0[4], a1[4];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
    int c = 0;
    for (; c + 32 <= I; c += 32) {
        const __m512 x0 = _mm512_loadu_ps(x + c), x1 = _mm512_loadu_ps(x + c + 16);
        for (int r = 0; r < R; r++) {
            _mm_prefetch((const char *)(w + (size_t)(R + r) * I + c), _MM_HINT_T0); /* the next group's rows */
            const __m512i h = _mm512_loadu_si512((const void *)(w + (size_t)r * I + c));
            a0[r] = _mm512_fmadd_ps(bf16_lo(h), x0, a0[r]);
            a1[r] = _mm512_fmadd_ps(bf16_hi(h), x1, a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float acc = _mm512_reduce_add_ps(_mm512_add_ps(a0[r], a1[r]));
        for (int k = c; k < I; k++) acc += bf16_scalar(w[(size_t)r * I + k]) * x[k];
        y[r] = acc;
    }
}
#elif defined(DSF_AVX2)
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

/* bf16_rows1 eight lanes at a time, two accumulators a row */
static inline __attribute__((always_inline)) void bf16_rows1(const uint16_t *w, int I, const float *x, float *y,
                                                             const int R) {
    __m256 a0[4], a1[4];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm256_setzero_ps();
    int c = 0;
    for (; c + 16 <= I; c += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + c), x1 = _mm256_loadu_ps(x + c + 8);
        for (int r = 0; r < R; r++) {
            if ((c & 31) == 0) _mm_prefetch((const char *)(w + (size_t)(R + r) * I + c), _MM_HINT_T0);
            a0[r] = _mm256_fmadd_ps(bf16x8(w + (size_t)r * I + c), x0, a0[r]);
            a1[r] = _mm256_fmadd_ps(bf16x8(w + (size_t)r * I + c + 8), x1, a1[r]);
        }
    }
    for (int r = 0; r < R; r++) {
        float acc = hsum8(_mm256_add_ps(a0[r], a1[r]));
        for (int k = c; k < I; k++) acc += bf16_scalar(w[(size_t)r * I + k]) * x[k];
        y[r] = acc;
    }
}
#endif

void bf16_gemv(const uint16_t *w, int O, int I, const float *x, int nx, float *y, int r0, int r1) {
#if defined(__AVX512F__) || defined(DSF_AVX2)
    if (nx == 1) {
        const int groups = (r1 - r0 + 3) / 4;
#pragma omp parallel for schedule(static) if ((size_t)(r1 - r0) * I > PARALLEL_ELEMENTS)
        for (int g = 0; g < groups; g++) {
            const int o = r0 + 4 * g;
            if (o + 4 <= r1)
                bf16_rows1(w + (size_t)o * I, I, x, y + o, 4);
            else
                for (int k = o; k < r1; k++) bf16_rows1(w + (size_t)k * I, I, x, y + k, 1);
        }
        return;
    }
#endif
#pragma omp parallel for schedule(static) if ((size_t)(r1 - r0) * I > PARALLEL_ELEMENTS)
    for (int o = r0; o < r1; o++) {
        const uint16_t *row = w + (size_t)o * I;
        for (int k0 = 0; k0 < nx; k0 += 2) {
            int kn = nx - k0 < 2 ? nx - k0 : 2;
            const float *x0 = x + (size_t)k0 * I, *x1 = x0 + (kn > 1 ? I : 0);
            float acc0 = 0, acc1 = 0;
            int c = 0;
#ifdef __AVX512F__
            __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps(), b0 = _mm512_setzero_ps(),
                   b1 = _mm512_setzero_ps();
            for (; c + 32 <= I; c += 32) {
                __m512i h = _mm512_loadu_si512((const void *)(row + c));
                __m512 lo = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(h)), 16));
                __m512 hi = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(h, 1)), 16));
                a0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x0 + c), a0);
                a1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x0 + c + 16), a1);
                if (kn > 1) {
                    b0 = _mm512_fmadd_ps(lo, _mm512_loadu_ps(x1 + c), b0);
                    b1 = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x1 + c + 16), b1);
                }
            }
            acc0 = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
            acc1 = _mm512_reduce_add_ps(_mm512_add_ps(b0, b1));
#elif defined(DSF_AVX2)
            __m256 a = _mm256_setzero_ps(), b = _mm256_setzero_ps();
            for (; c + 8 <= I; c += 8) {
                const __m256 v = bf16x8(row + c);
                a = _mm256_fmadd_ps(v, _mm256_loadu_ps(x0 + c), a);
                if (kn > 1) b = _mm256_fmadd_ps(v, _mm256_loadu_ps(x1 + c), b);
            }
            acc0 = hsum8(a);
            acc1 = hsum8(b);
#endif
            for (; c < I; c++) {
                float v = bf16_scalar(row[c]);
                acc0 += v * x0[c];
                acc1 += v * x1[c];
            }
            y[(size_t)k0 * O + o] = acc0;
            if (kn > 1) y[(size_t)(k0 + 1) * O + o] = acc1;
        }
    }
}

/* rows idx[0..n) of W [., I] against one vector: y[j] = W[idx[j]] . x, each row bf16_gemv's own bits (the head's
 * re-scored rows, read in place instead of gathered first) */
void bf16_gemv_rows(const uint16_t *w, int I, const int64_t *idx, int n, const float *x, float *y) {
#pragma omp parallel for schedule(static) if ((size_t)n * I > PARALLEL_ELEMENTS)
    for (int j = 0; j < n; j++) bf16_gemv(w + (size_t)idx[j] * I, 1, I, x, 1, y + j, 0, 1);
}

/* one FP8 row with its scales (x 256, as above) -> I values at out, fp32 or bfloat16 (bf16 != 0; exact: an FP8 value
 * times a power of two has at most 4 significant bits) */
static void expand_row(const uint8_t *row, const float *sr, int I, int B, void *out, int bf16) {
    float *f32 = (float *)out;
    uint16_t *h16 = (uint16_t *)out;
    int c = 0;
#ifdef __AVX512F__
    if (B % 32 == 0 && I % B == 0) {
        for (int j = 0; c < I; j++) {
            __m512 s = _mm512_set1_ps(sr[j]);
            for (int end = c + B; c < end; c += 32) {
                __m512 lo, hi;
                e4m3x32_scaled(row + c, s, &lo, &hi);
                if (bf16) {
                    _mm256_storeu_si256((__m256i *)(h16 + c),
                                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(lo), 16)));
                    _mm256_storeu_si256((__m256i *)(h16 + c + 16),
                                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(hi), 16)));
                } else {
                    _mm512_storeu_ps(f32 + c, lo);
                    _mm512_storeu_ps(f32 + c + 16, hi);
                }
            }
        }
    }
#elif defined(DSF_AVX2)
    if (B % 16 == 0 && I % B == 0) {
        for (int j = 0; c < I; j++) {
            const __m256 s = _mm256_set1_ps(sr[j]);
            for (int end = c + B; c < end; c += 16) {
                __m256 lo, hi;
                e4m3x16(row + c, &lo, &hi);
                lo = _mm256_mul_ps(lo, s);
                hi = _mm256_mul_ps(hi, s);
                if (bf16) {
                    store_bf16x16(h16 + c, lo, hi);
                } else {
                    _mm256_storeu_ps(f32 + c, lo);
                    _mm256_storeu_ps(f32 + c + 8, hi);
                }
            }
        }
    }
#endif
    for (; c < I; c++) {
        float v = e4m3_scalar(row[c]) * sr[c / B] / 256.0f;
        if (bf16) {
            uint32_t bits;
            memcpy(&bits, &v, 4);
            h16[c] = (uint16_t)(bits >> 16);
        } else {
            f32[c] = v;
        }
    }
}

/* FP8 rows [r0, r1) -> [O, I] with the block scales applied, fp32 or bfloat16, for matrix products (prefill). */
void fp8_expand(const uint8_t *w, const float *scale, int O, int I, int B, void *out, int bf16, int r0, int r1) {
    const int nbc = (I + B - 1) / B;
    (void)O;
#pragma omp parallel for schedule(static) if ((size_t)(r1 - r0) * I > PARALLEL_ELEMENTS)
    for (int o = r0; o < r1; o++)
        expand_row(w + (size_t)o * I, scale + (size_t)(o / B) * nbc, I, B, (uint8_t *)out + (size_t)o * I * (bf16 ? 2 : 4),
                   bf16);
}

/* FP8 rows [r0, r0 + 32) x columns [c0, c1) -> 32 fp32 rows at out, ld apart (rows past O zero): one k-block of a
 * panel of a fused fp32 product (packed_cpu.c); c0 a multiple of B */
void fp8_block_f32(const uint8_t *w, const float *scale, int O, int I, int B, int r0, int c0, int c1, float *out,
                   int ld) {
    const int nbc = (I + B - 1) / B;
    for (int o = r0; o < r0 + 32; o++) {
        float *dst = out + (size_t)(o - r0) * ld;
        if (o < O)
            expand_row(w + (size_t)o * I + c0, scale + (size_t)(o / B) * nbc + c0 / B, c1 - c0, B, dst, 0);
        else
            memset(dst, 0, (size_t)(c1 - c0) * 4);
    }
}

/* FP8 rows [r0, r0 + 32) -> 32 bfloat16 rows at out (rows past O zero): one panel of a fused product */
void fp8_panel_bf16(const uint8_t *w, const float *scale, int O, int I, int B, int r0, uint16_t *out) {
    const int nbc = (I + B - 1) / B;
    for (int o = r0; o < r0 + 32; o++) {
        uint16_t *dst = out + (size_t)(o - r0) * I;
        if (o < O)
            expand_row(w + (size_t)o * I, scale + (size_t)(o / B) * nbc, I, B, dst, 1);
        else
            memset(dst, 0, (size_t)I * 2);
    }
}

/* the heap of top_indices: (value, index) pairs, the root the worst kept (smallest value, then latest index) */
static void heap_push(float *hv, int64_t *idx, int *size, int k, float v, int64_t i) {
    int at;
    if (*size < k) { /* sift up (an equal parent has an earlier index: better) */
        at = (*size)++;
        while (at > 0 && hv[(at - 1) / 2] >= v) {
            hv[at] = hv[(at - 1) / 2];
            idx[at] = idx[(at - 1) / 2];
            at = (at - 1) / 2;
        }
    } else { /* replace the root, sift down past every worse child */
        at = 0;
        for (;;) {
            int c = 2 * at + 1;
            if (c >= k) break;
            if (c + 1 < k && (hv[c + 1] < hv[c] || (hv[c + 1] == hv[c] && idx[c + 1] > idx[c]))) c++;
            if (hv[c] >= v) break;
            hv[at] = hv[c];
            idx[at] = idx[c];
            at = c;
        }
    }
    hv[at] = v;
    idx[at] = i;
}

/* Indices of the k largest of x[0..n) into idx (in no particular order; ties at the boundary keep the earlier
 * index), one pass with a min-heap of the best k, 16 values compared with the heap's worst at once: the screened
 * head's candidates among 129280 logits (torch's topk: 0.4-1.5 ms a step). NaN never enters. */
void top_indices(const float *x, int64_t n, int k, int64_t *idx) {
    if (k <= 0) return;
    float hv[k];
    int size = 0;
    int64_t i = 0;
    for (; i < n && size < k; i++) heap_push(hv, idx, &size, k, x[i], i);
#ifdef __AVX512F__
    for (; i + 16 <= n; i += 16) {
        __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(x + i), _mm512_set1_ps(hv[0]), _CMP_GT_OQ);
        while (hit) {
            const int b = __builtin_ctz(hit);
            hit &= hit - 1;
            if (x[i + b] > hv[0]) heap_push(hv, idx, &size, k, x[i + b], i + b);
        }
    }
#elif defined(DSF_AVX2)
    for (; i + 8 <= n; i += 8) {
        unsigned hit = (unsigned)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), _mm256_set1_ps(hv[0]), _CMP_GT_OQ));
        while (hit) {
            const int b = __builtin_ctz(hit);
            hit &= hit - 1;
            if (x[i + b] > hv[0]) heap_push(hv, idx, &size, k, x[i + b], i + b);
        }
    }
#endif
    for (; i < n; i++)
        if (x[i] > hv[0]) heap_push(hv, idx, &size, k, x[i], i);
}
