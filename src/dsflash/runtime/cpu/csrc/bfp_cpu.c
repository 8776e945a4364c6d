/* CPU kernels over Tenstorrent block-float tiles (bfp4_b / bfp8_b), the format of the expert slots.
 *
 * Layout (docs/bfp_format.md): 32x32 tiles in row-major tile order; a tile is 64 exponent bytes (face f, row r at
 * 16f + r) followed by the codes of faces 0..3 (face 0 = rows 0-15 x cols 0-15, 1 = rows 0-15 x cols 16-31,
 * 2 = rows 16-31 x cols 0-15, 3 = rows 16-31 x cols 16-31), each face 16 rows of 16 sign-magnitude codes.
 * value = (-1)^s * q * 2^(E - 127 - (m - 1)) with m = 3 (bfp4_b: nibbles, low nibble first) or 7 (bfp8_b: bytes).
 *
 * Built at first use with the system C compiler (-O3 -march=native -fopenmp) by runtime/cpu/native.py, which links
 * the OpenMP runtime torch already loaded, so these kernels share torch's thread team instead of fighting it.
 * AVX2 CPUs (simd.h's DSF_AVX2) have their own loops; the generic loops are the fallback everywhere else. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "simd.h"

/* below this many tiles a call runs on one thread: waking the team costs more than it saves */
#define PARALLEL_TILES 256

static inline int tile_bytes(int m) { return 64 + 1024 * (m + 1) / 8; }
static inline int face_bytes(int m) { return 256 * (m + 1) / 8; }
static inline int row_bytes(int m) { return 16 * (m + 1) / 8; }

static void scales(int m, float *sc) {
    for (int e = 0; e < 256; e++) sc[e] = ldexpf(1.0f, e - 127 - (m - 1));
}

static inline void decode_row(const uint8_t *d, int m, float *v) {
    if (m == 3) {
        for (int j = 0; j < 8; j++) {
            int lo = d[j] & 15, hi = d[j] >> 4;
            v[2 * j] = (lo & 8) ? -(float)(lo & 7) : (float)(lo & 7);
            v[2 * j + 1] = (hi & 8) ? -(float)(hi & 7) : (float)(hi & 7);
        }
    } else {
        for (int j = 0; j < 16; j++) v[j] = (d[j] & 128) ? -(float)(d[j] & 127) : (float)(d[j] & 127);
    }
}

#ifdef __AVX512F__
static inline __m512 decode_row_avx512(const uint8_t *d, int m) {
    if (m == 3) {
        const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -0.0f, -1, -2, -3, -4, -5, -6, -7);
        const __m128i low4 = _mm_set1_epi8(15);
        __m128i b = _mm_loadl_epi64((const __m128i *)d);
        __m128i lo = _mm_and_si128(b, low4);
        __m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), low4);
        return _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), lut);
    }
    __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)d));
    __m512 mag = _mm512_cvtepi32_ps(_mm512_and_si512(c, _mm512_set1_epi32(127)));
    __m512i sgn = _mm512_slli_epi32(_mm512_and_si512(c, _mm512_set1_epi32(128)), 24);
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(mag), sgn));
}
#endif

#if defined(__AVX512F__) || defined(DSF_AVX2)
/* The decode kernels do a few instructions per byte, and one core's hardware prefetcher alone keeps too few lines
 * in flight to feed them: asking for the tile a few tiles ahead took the bfp4_b GEMV from 11.7 to 15.1 GB/s and
 * bfp8_b's from 11.4 to 14.1 on 2 cores (fp8_gemv, four rows in flight, gained nothing from it). A prefetch past
 * the end of a matrix is a harmless hint. */
#define PREFETCH_AHEAD 4
#define PREFETCH_TILE(p, n)                                                                                            \
    for (int l_ = 0; l_ < (n); l_ += 64) _mm_prefetch((const char *)(p) + l_, _MM_HINT_T0)
#endif

#ifdef __AVX512F__

/* The tile PREFETCH_AHEAD tiles after tile tj of a tile row at t: past the row's end, the row read next, `next`
 * (NULL: the following row of the same matrix). A decode MoE alternates matrices and experts row by row, and each
 * row started cold before (bfp_moe_decode is 2-5 % shorter with the hint, same bits). */
static inline const uint8_t *ahead(const uint8_t *t, int tj, int tc, int tb, const uint8_t *next) {
    return next == NULL || tj + PREFETCH_AHEAD < tc ? t + PREFETCH_AHEAD * tb
                                                    : next + (size_t)(tj + PREFETCH_AHEAD - tc) * tb;
}

/* one vector x, tile row ti -> its 32 outputs: the 16 accumulators of a half tile row stay in registers (the loops
 * have constant bounds) */
static inline void row32_avx512(const uint8_t *tiles, int tc, int m, const float *sc, const float *x, int ti,
                                const uint8_t *next, float *y32) {
    const int tb = tile_bytes(m), fb = face_bytes(m), rb = row_bytes(m);
    for (int h = 0; h < 2; h++) {
        __m512 acc[16];
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
        for (int tj = 0; tj < tc; tj++) {
            const uint8_t *t = tiles + ((size_t)ti * tc + tj) * tb;
            PREFETCH_TILE(ahead(t, tj, tc, tb, h ? next : NULL), tb); /* the second pass ends the row */
            for (int fc = 0; fc < 2; fc++) {
                const int f = 2 * h + fc;
                const __m512 xv = _mm512_loadu_ps(x + tj * 32 + fc * 16);
                const uint8_t *d = t + 64 + f * fb, *e = t + 16 * f;
#pragma GCC unroll 16
                for (int r = 0; r < 16; r++) {
                    __m512 v = _mm512_mul_ps(decode_row_avx512(d + r * rb, m), _mm512_set1_ps(sc[e[r]]));
                    acc[r] = _mm512_fmadd_ps(v, xv, acc[r]);
                }
            }
        }
#pragma GCC unroll 16
        for (int r = 0; r < 16; r++) y32[16 * h + r] = _mm512_reduce_add_ps(acc[r]);
    }
}

static void gemv1_avx512(const uint8_t *tiles, int tc, int m, const float *sc, const float *x, float *y, int tr0,
                         int tr1) {
#pragma omp parallel for schedule(static) if ((size_t)(tr1 - tr0) * tc > PARALLEL_TILES)
    for (int ti = tr0; ti < tr1; ti++) row32_avx512(tiles, tc, m, sc, x, ti, NULL, y + ti * 32);
}
#endif

#ifdef __AVX512F__
/* a bfp4_b code (sign, 3 magnitude bits) as the bf16 bits of its integer value, twice: a 32-entry word permute's
 * table (the permute reads 5 index bits; the fifth, the next nibble's low bit, selects the same entry) */
static const uint16_t BFP4_BF16[32] = {
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x8000, 0xbf80, 0xc000, 0xc040, 0xc080, 0xc0a0, 0xc0c0, 0xc0e0,
    0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0, 0x8000, 0xbf80, 0xc000, 0xc040, 0xc080, 0xc0a0, 0xc0c0, 0xc0e0};

/* a bfp4_b face's 16 row scales 2^(e - 127 - 2) as in scales(): e << 23 is 2^(e-127) (0 for e = 0, where every
 * code is 0 anyway); e = 255 keeps the table's finite 2^126 */
static inline __m512 bfp4_face_scales(const uint8_t *tile, int f) {
    const __m512i e = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(tile + 16 * f)));
    const __m512 sf = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(e, 23)), _mm512_set1_ps(0.25f));
    return _mm512_mask_blend_ps(_mm512_cmpeq_epi32_mask(e, _mm512_set1_epi32(255)), sf, _mm512_set1_ps(0x1p126f));
}

/* face rows 4k .. 4k + 3 (32 code bytes at d + 32 k) -> their weights as four fp32 vectors, lane j of vector c
 * holding face row 4k + j / 4's column 4 (j % 4) + c (the order put_q4 gives x) */
static inline void bfp4_rows4(const uint8_t *d, int k, __m512i lut, __m512 *w) {
    const __m512i hiword = _mm512_set1_epi32((int)0xFFFF0000u);
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(d + 32 * k)));
    const __m512i lo = _mm512_permutexvar_epi16(b, lut);
    const __m512i hi = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), lut);
    w[0] = _mm512_castsi512_ps(_mm512_slli_epi32(lo, 16));
    w[1] = _mm512_castsi512_ps(_mm512_slli_epi32(hi, 16));
    w[2] = _mm512_castsi512_ps(_mm512_and_si512(lo, hiword));
    w[3] = _mm512_castsi512_ps(_mm512_and_si512(hi, hiword));
}

/* bfp4_rows4's weights against x's four column classes at xs (put_q4 form): each lane's four products, summed */
static inline __m512 bfp4_dot(const __m512 *w, const float *xs) {
    __m512 p = _mm512_mul_ps(w[0], _mm512_loadu_ps(xs));
    p = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xs + 16), p);
    p = _mm512_fmadd_ps(w[2], _mm512_loadu_ps(xs + 32), p);
    return _mm512_fmadd_ps(w[3], _mm512_loadu_ps(xs + 48), p);
}

/* the face-row scales of rows 4k .. 4k + 3 spread over bfp4_rows4's lanes */
static inline __m512 bfp4_scales4(__m512 sf, int k) {
    const __m512i rows = _mm512_setr_epi32(4 * k, 4 * k, 4 * k, 4 * k, 4 * k + 1, 4 * k + 1, 4 * k + 1, 4 * k + 1,
                                           4 * k + 2, 4 * k + 2, 4 * k + 2, 4 * k + 2, 4 * k + 3, 4 * k + 3, 4 * k + 3,
                                           4 * k + 3);
    return _mm512_permutexvar_ps(rows, sf);
}

/* bfp4_b tile rows against vectors, nr (1 or 2) at once: tile row t[r] (tc tiles) against xq[r] -> 32 outputs y[r];
 * next[r]: the row stream r reads after this one (prefetched past the end; NULL: the memory that follows).
 * 32 code bytes (four face rows) widen to 16-bit words; the word permute turns each word's low nibble, and after a
 * shift its high nibble, into the bf16 bits of the code's integer, and a shift or a mask makes those exact fp32
 * values: lane j of the four vectors holds face row j / 4's columns 4 (j % 4) + 0, 1, 2, 3 (x comes split into
 * those four column classes, put_q4). One shuffle-port operation per 21 codes where the dword permutes took one
 * per 11 (the fp32 products and sums are the same kind: exact weights, fp32 x), and eight accumulators a tile row,
 * so two tile rows run as two memory streams: 20-21 against 16-17 GB/s from memory on 2 cores. Every row takes
 * the same operations in the same order whichever rows run beside it, so a TP shard's rows have TP 1's bits. */
static inline void rows_bfp4(const int nr, const uint8_t *const *t, const float *const *xq,
                             const uint8_t *const *next, int tc, float *const *y) {
    const int tb = tile_bytes(3), fb = face_bytes(3);
    const __m512i lut = _mm512_loadu_si512(BFP4_BF16);
    __m512 acc[2][8];
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < 8; q++) acc[r][q] = _mm512_setzero_ps();
    for (int tj = 0; tj < tc; tj++) {
        for (int r = 0; r < nr; r++) {
            const uint8_t *tile = t[r] + (size_t)tj * tb;
            PREFETCH_TILE(ahead(tile, tj, tc, tb, next[r]), tb);
#pragma GCC unroll 4
            for (int f = 0; f < 4; f++) {
                const float *xs = xq[r] + (size_t)(2 * tj + (f & 1)) * 64;
                const __m512 sf = bfp4_face_scales(tile, f);
                const uint8_t *d = tile + 64 + f * fb;
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    __m512 w[4];
                    bfp4_rows4(d, k, lut, w);
                    const int q = 4 * (f >> 1) + k; /* rows 4q .. 4q + 3 of the tile row */
                    acc[r][q] = _mm512_fmadd_ps(bfp4_dot(w, xs), bfp4_scales4(sf, k), acc[r][q]);
                }
            }
        }
    }
    for (int r = 0; r < nr; r++)
        for (int q = 0; q < 8; q++) { /* each row's four lanes: (l0 + l1) + (l2 + l3) */
            __m512 a = _mm512_add_ps(acc[r][q], _mm512_permute_ps(acc[r][q], 0xB1));
            a = _mm512_add_ps(a, _mm512_permute_ps(a, 0x4E));
            _mm_storeu_ps(y[r] + 4 * q, _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, a)));
        }
}

/* tile rows [tr0, tr1) against one vector (put_q4 form), two at a time */
static void gemv1_bfp4(const uint8_t *tiles, int tc, const float *xq, float *y, int tr0, int tr1) {
    const size_t rowb = (size_t)tc * tile_bytes(3);
    const int pairs = (tr1 - tr0 + 1) / 2;
#pragma omp parallel for schedule(static) if ((size_t)(tr1 - tr0) * tc > PARALLEL_TILES)
    for (int pi = 0; pi < pairs; pi++) {
        const int ti = tr0 + 2 * pi, nr = ti + 1 < tr1 ? 2 : 1;
        const uint8_t *t[2] = {tiles + ti * rowb, tiles + (ti + 1) * rowb};
        const uint8_t *nx[2] = {tiles + (ti + 2) * rowb, tiles + (ti + 3) * rowb}; /* this thread's next pair */
        const float *xs[2] = {xq, xq};
        float *ys[2] = {y + ti * 32, y + ti * 32 + 32};
        if (nr == 2)
            rows_bfp4(2, t, xs, nx, tc, ys);
        else
            rows_bfp4(1, t, xs, nx, tc, ys);
    }
}

/* rows_bfp4 for one tile row t against K <= 4 vectors (put_q4 form): each row's four face pairs decoded once for
 * all of them. The tile row goes in two halves (faces 0-1, then 2-3), each with its own four accumulators a
 * vector, so that a vector's every accumulator takes rows_bfp4's operations in rows_bfp4's order: a batched
 * decode step's vector gets the bits it gets alone. next: the row read after this one (prefetched). */
static inline __attribute__((always_inline)) void rows_bfp4_vecs(const uint8_t *t, const uint8_t *next, int tc,
                                                                 const float *const *xq, float *const *y,
                                                                 const int K) {
    const int tb = tile_bytes(3), fb = face_bytes(3);
    const __m512i lut = _mm512_loadu_si512(BFP4_BF16);
    for (int h = 0; h < 2; h++) {
        __m512 acc[4][4];
        for (int v = 0; v < K; v++)
            for (int k = 0; k < 4; k++) acc[v][k] = _mm512_setzero_ps();
        for (int tj = 0; tj < tc; tj++) {
            const uint8_t *tile = t + (size_t)tj * tb;
            PREFETCH_TILE(h ? ahead(tile, tj, tc, tb, next) : tile + PREFETCH_AHEAD * tb, tb);
            for (int fh = 0; fh < 2; fh++) {
                const int f = 2 * h + fh;
                const __m512 sf = bfp4_face_scales(tile, f);
                const uint8_t *d = tile + 64 + f * fb;
#pragma GCC unroll 4
                for (int k = 0; k < 4; k++) {
                    __m512 w[4];
                    bfp4_rows4(d, k, lut, w);
                    const __m512 sk = bfp4_scales4(sf, k);
                    for (int v = 0; v < K; v++)
                        acc[v][k] = _mm512_fmadd_ps(bfp4_dot(w, xq[v] + (size_t)(2 * tj + (f & 1)) * 64), sk, acc[v][k]);
                }
            }
        }
        for (int v = 0; v < K; v++)
            for (int k = 0; k < 4; k++) { /* rows_bfp4's reduction */
                __m512 a = _mm512_add_ps(acc[v][k], _mm512_permute_ps(acc[v][k], 0xB1));
                a = _mm512_add_ps(a, _mm512_permute_ps(a, 0x4E));
                _mm_storeu_ps(y[v] + 16 * h + 4 * k, _mm512_castps512_ps128(_mm512_maskz_compress_ps(0x1111, a)));
            }
    }
}

static inline void put_q4(const float *x16, float *seg64);

/* tile rows [tr0, tr1) against nx vectors x [nx, 32 tc] -> y [nx, out], as nx calls of the one-vector loop give
 * them; xq: nx * 128 tc floats of scratch for put_q4's form */
static void gemvk_bfp4(const uint8_t *tiles, int tc, const float *x, int nx, float *xq, float *y, int out, int tr0,
                       int tr1) {
    const size_t rowb = (size_t)tc * tile_bytes(3), in = (size_t)tc * 32, qn = (size_t)tc * 128;
    for (int k = 0; k < nx; k++)
        for (int s = 0; s < 2 * tc; s++) put_q4(x + k * in + s * 16, xq + k * qn + s * 64);
#pragma omp parallel for schedule(static) if ((size_t)(tr1 - tr0) * tc > PARALLEL_TILES)
    for (int ti = tr0; ti < tr1; ti++) {
        const uint8_t *t = tiles + ti * rowb;
        for (int k0 = 0; k0 < nx; k0 += 4) {
            const int kn = nx - k0 < 4 ? nx - k0 : 4;
            const float *xs[4];
            float *ys[4];
            for (int v = 0; v < kn; v++) xs[v] = xq + (k0 + v) * qn, ys[v] = y + (size_t)(k0 + v) * out + ti * 32;
            const uint8_t *nx_row = k0 + 4 < nx ? t : t + rowb; /* the next group of vectors reads this row again */
            if (kn == 4)
                rows_bfp4_vecs(t, nx_row, tc, xs, ys, 4);
            else if (kn == 3)
                rows_bfp4_vecs(t, nx_row, tc, xs, ys, 3);
            else if (kn == 2)
                rows_bfp4_vecs(t, nx_row, tc, xs, ys, 2);
            else
                rows_bfp4_vecs(t, nx_row, tc, xs, ys, 1);
        }
    }
}

#endif

#ifdef DSF_AVX2
/* A face row (16 codes) -> two vectors of 8 fp32, the integer values q with their signs. GEMV: the signed 8-bit
 * integers first, in one or two byte operations (a table lookup for bfp4_b's nibbles, psignb for bfp8_b); "-0"
 * becomes +0 there, which changes only a product's sign of zero. Expansion keeps the exact -0 of the generic loops. */
static inline void decode_row_avx2(const uint8_t *d, int m, int exact, __m256 *lo, __m256 *hi) {
    if (m == 3) {
        const __m128i low4 = _mm_set1_epi8(15);
        const __m128i b = _mm_loadl_epi64((const __m128i *)d);
        const __m128i c = _mm_unpacklo_epi8(_mm_and_si128(b, low4), _mm_and_si128(_mm_srli_epi16(b, 4), low4));
        if (!exact) {
            const __m128i lut = _mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, 0, -1, -2, -3, -4, -5, -6, -7);
            const __m128i q = _mm_shuffle_epi8(lut, c);
            *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
            return;
        }
        const __m256i c0 = _mm256_cvtepu8_epi32(c), c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(c, 8));
        const __m256i seven = _mm256_set1_epi32(7), eight = _mm256_set1_epi32(8);
        *lo = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_and_si256(c0, seven))),
                                                   _mm256_slli_epi32(_mm256_and_si256(c0, eight), 28)));
        *hi = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_and_si256(c1, seven))),
                                                   _mm256_slli_epi32(_mm256_and_si256(c1, eight), 28)));
        return;
    }
    const __m128i b = _mm_loadu_si128((const __m128i *)d);
    if (!exact) { /* psignb: the magnitude negated where the code's top bit (its sign) is set */
        const __m128i q = _mm_sign_epi8(_mm_and_si128(b, _mm_set1_epi8(127)), b);
        *lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        *hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
        return;
    }
    const __m256i c0 = _mm256_cvtepu8_epi32(b), c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(b, 8));
    const __m256i mag = _mm256_set1_epi32(127), sgn = _mm256_set1_epi32(128);
    *lo = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_and_si256(c0, mag))),
                                               _mm256_slli_epi32(_mm256_and_si256(c0, sgn), 24)));
    *hi = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(_mm256_cvtepi32_ps(_mm256_and_si256(c1, mag))),
                                               _mm256_slli_epi32(_mm256_and_si256(c1, sgn), 24)));
}

/* Rows [r0, r0 + R) of half h of one tile row (tc tiles at row) against K vectors (R K <= 8 accumulators: AVX2 has
 * 16 registers), y[k][r] = the row's dot product. Every row takes the same operations in the same order whichever
 * rows and vectors run beside it, so a TP shard's rows and a batch's vectors have the bits of one row alone. */
static inline __attribute__((always_inline)) void rows_avx2(const uint8_t *row, int tc, int m, const float *sc,
                                                             const float *const *x, const int K, int h, int r0,
                                                             const int R, float *const *y) {
    const int tb = tile_bytes(m), fb = face_bytes(m), rb = row_bytes(m);
    __m256 acc[8];
    for (int i = 0; i < R * K; i++) acc[i] = _mm256_setzero_ps();
    for (int tj = 0; tj < tc; tj++) {
        const uint8_t *t = row + (size_t)tj * tb;
        if (h == 0 && r0 == 0) /* the first pass over the tile row brings it in (the rest find it in L2) */
            PREFETCH_TILE(t + PREFETCH_AHEAD * tb, tb);
        for (int fc = 0; fc < 2; fc++) {
            const int f = 2 * h + fc;
            __m256 xl[4], xh[4];
            for (int k = 0; k < K; k++) {
                xl[k] = _mm256_loadu_ps(x[k] + tj * 32 + fc * 16);
                xh[k] = _mm256_loadu_ps(x[k] + tj * 32 + fc * 16 + 8);
            }
            const uint8_t *d = t + 64 + f * fb, *e = t + 16 * f;
            for (int r = 0; r < R; r++) {
                __m256 lo, hi;
                decode_row_avx2(d + (r0 + r) * rb, m, 0, &lo, &hi);
                const __m256 s = _mm256_set1_ps(sc[e[r0 + r]]);
                lo = _mm256_mul_ps(lo, s);
                hi = _mm256_mul_ps(hi, s);
                for (int k = 0; k < K; k++) {
                    acc[k * R + r] = _mm256_fmadd_ps(lo, xl[k], acc[k * R + r]);
                    acc[k * R + r] = _mm256_fmadd_ps(hi, xh[k], acc[k * R + r]);
                }
            }
        }
    }
    for (int k = 0; k < K; k++)
        for (int r = 0; r < R; r++) y[k][r] = hsum8(acc[k * R + r]);
}

/* tile row ti against one vector -> its 32 outputs, eight rows at a time */
static inline void row32_avx2(const uint8_t *tiles, int tc, int m, const float *sc, const float *x, int ti,
                              float *y32) {
    const uint8_t *row = tiles + (size_t)ti * tc * tile_bytes(m);
    const float *xs[1] = {x};
    for (int q = 0; q < 4; q++) {
        float *ys[1] = {y32 + 8 * q};
        rows_avx2(row, tc, m, sc, xs, 1, q >> 1, 8 * (q & 1), 8, ys);
    }
}

/* tile row ti against vectors x0 and x1 (rows of length in) -> 32 outputs each, four rows at a time */
static inline void row32x2_avx2(const uint8_t *tiles, int tc, int m, const float *sc, const float *x0,
                                const float *x1, int ti, float *y0, float *y1) {
    const uint8_t *row = tiles + (size_t)ti * tc * tile_bytes(m);
    const float *xs[2] = {x0, x1};
    for (int q = 0; q < 8; q++) {
        float *ys[2] = {y0 + 4 * q, y1 + 4 * q};
        rows_avx2(row, tc, m, sc, xs, 2, q >> 2, 4 * (q & 3), 4, ys);
    }
}

/* tile row ti against K = 3 or 4 vectors -> 32 outputs each, two rows at a time (a row decoded once for all K) */
static inline __attribute__((always_inline)) void row32xk_avx2(const uint8_t *tiles, int tc, int m, const float *sc,
                                                                const float *x, int in, int ti, float *y, int out,
                                                                const int K) {
    const uint8_t *row = tiles + (size_t)ti * tc * tile_bytes(m);
    const float *xs[4] = {x, x + in, x + 2 * (size_t)in, x + 3 * (size_t)in};
    for (int q = 0; q < 16; q++) {
        float *ys[4] = {y + 2 * q, y + out + 2 * q, y + 2 * (size_t)out + 2 * q, y + 3 * (size_t)out + 2 * q};
        rows_avx2(row, tc, m, sc, xs, K, q >> 3, 2 * (q & 7), 2, ys);
    }
}
#endif

/* 16 columns of x -> the form rows_bfp4 reads: four column classes of 16 lanes, lane j of class k = x[4 (j % 4) + k] */
static inline void put_q4(const float *x16, float *seg64) {
    for (int k = 0; k < 4; k++)
        for (int j = 0; j < 16; j++) seg64[16 * k + j] = x16[4 * (j % 4) + k];
}

/* the portable loops: tile row ti of W against one vector x -> its 32 outputs */
static inline void row32_generic(const uint8_t *tiles, int tc, int m, const float *sc, const float *x, int ti,
                                 float *y32) {
    const int tb = tile_bytes(m), fb = face_bytes(m), rb = row_bytes(m);
    float v[16];
    memset(y32, 0, 32 * sizeof(float));
    for (int tj = 0; tj < tc; tj++) {
        const uint8_t *t = tiles + ((size_t)ti * tc + tj) * tb;
        for (int f = 0; f < 4; f++) {
            const uint8_t *d = t + 64 + f * fb;
            for (int r = 0; r < 16; r++) {
                int e = t[16 * f + r];
                if (e == 0) continue;
                decode_row(d + r * rb, m, v);
                const float *xs = x + tj * 32 + (f & 1) * 16;
                float dot = 0;
                for (int c = 0; c < 16; c++) dot += v[c] * xs[c];
                y32[(f >> 1) * 16 + r] += sc[e] * dot;
            }
        }
    }
}

/* y[k, o] = sum_i W[o, i] x[k, i] for tile rows [tr0, tr1).
 * tiles: W [tr*32, tc*32] packed; x: [nx, tc*32] fp32; y: [nx, tr*32] fp32. Best for a few vectors (decode). */
void bfp_gemv(const uint8_t *tiles, int tr, int tc, int m, const float *x, int nx, float *y, int tr0, int tr1) {
    const int in = tc * 32, out = tr * 32;
    float sc[256];
    scales(m, sc);
#ifdef __AVX512F__
    const int tb = tile_bytes(m), fb = face_bytes(m), rb = row_bytes(m);
    if (nx == 1 && m == 3) {
        float xq[tc * 128];
        for (int s = 0; s < 2 * tc; s++) put_q4(x + s * 16, xq + s * 64);
        gemv1_bfp4(tiles, tc, xq, y, tr0, tr1);
        return;
    }
    if (nx == 1) {
        gemv1_avx512(tiles, tc, m, sc, x, y, tr0, tr1);
        return;
    }
    if (m == 3) { /* the one-vector loop's math for each vector (row32_avx512's below is bfp8_b's, the same bits) */
        float *xq = malloc((size_t)nx * tc * 128 * sizeof(float));
        if (xq != NULL) {
            gemvk_bfp4(tiles, tc, x, nx, xq, y, out, tr0, tr1);
            free(xq);
            return;
        }
    }
    for (int k0 = 0; k0 < nx; k0 += 4) {
        int kn = nx - k0 < 4 ? nx - k0 : 4;
#pragma omp parallel for schedule(static) if ((size_t)(tr1 - tr0) * tc > PARALLEL_TILES)
        for (int ti = tr0; ti < tr1; ti++) {
            for (int h = 0; h < 2; h++) { /* 16 output rows at a time: 16 (x kn) accumulators */
                __m512 acc[4][16];
                for (int k = 0; k < kn; k++)
                    for (int r = 0; r < 16; r++) acc[k][r] = _mm512_setzero_ps();
                for (int tj = 0; tj < tc; tj++) {
                    const uint8_t *t = tiles + ((size_t)ti * tc + tj) * tb;
                    PREFETCH_TILE(t + PREFETCH_AHEAD * tb, tb);
                    for (int fc = 0; fc < 2; fc++) {
                        int f = 2 * h + fc;
                        __m512 xv[4];
                        for (int k = 0; k < kn; k++) xv[k] = _mm512_loadu_ps(x + (size_t)(k0 + k) * in + tj * 32 + fc * 16);
                        const uint8_t *d = t + 64 + f * fb;
                        for (int r = 0; r < 16; r++) {
                            __m512 v = _mm512_mul_ps(decode_row_avx512(d + r * rb, m), _mm512_set1_ps(sc[t[16 * f + r]]));
                            for (int k = 0; k < kn; k++) acc[k][r] = _mm512_fmadd_ps(v, xv[k], acc[k][r]);
                        }
                    }
                }
                for (int k = 0; k < kn; k++)
                    for (int r = 0; r < 16; r++)
                        y[(size_t)(k0 + k) * out + ti * 32 + 16 * h + r] = _mm512_reduce_add_ps(acc[k][r]);
            }
        }
    }
#elif defined(DSF_AVX2)
#pragma omp parallel for schedule(static) if ((size_t)(tr1 - tr0) * tc * nx > PARALLEL_TILES)
    for (int ti = tr0; ti < tr1; ti++) {
        int k = 0;
        for (; k + 4 <= nx; k += 4)
            row32xk_avx2(tiles, tc, m, sc, x + (size_t)k * in, in, ti, y + (size_t)k * out + ti * 32, out, 4);
        if (nx - k == 3) {
            row32xk_avx2(tiles, tc, m, sc, x + (size_t)k * in, in, ti, y + (size_t)k * out + ti * 32, out, 3);
            k += 3;
        }
        for (; k + 2 <= nx; k += 2) {
            const float *x0 = x + (size_t)k * in;
            row32x2_avx2(tiles, tc, m, sc, x0, x0 + in, ti, y + (size_t)k * out + ti * 32,
                         y + (size_t)(k + 1) * out + ti * 32);
        }
        if (k < nx) row32_avx2(tiles, tc, m, sc, x + (size_t)k * in, ti, y + (size_t)k * out + ti * 32);
    }
#else
    for (int ti = tr0; ti < tr1; ti++)
        for (int k = 0; k < nx; k++) row32_generic(tiles, tc, m, sc, x + (size_t)k * in, ti, y + (size_t)k * out + ti * 32);
#endif
}

/* Tile rows a (against xa) and b (against xb; NULL: a alone) -> ya, yb, each vector in the form the format's
 * one-vector loop reads (bfp4_b on AVX-512: put_q4's four column classes, 128 floats per 32 columns; otherwise
 * plain); na / nb: what each stream reads next. The operations of bfp_gemv's nx = 1: the same bits. */
#ifdef __AVX512F__
#define Q4_FORM(m) ((m) == 3)
static inline void row_pair(int m, const float *sc, int tc, const uint8_t *a, const float *xa, const uint8_t *na,
                            float *ya, const uint8_t *b, const float *xb, const uint8_t *nb, float *yb) {
    if (m == 3) {
        const uint8_t *t[2] = {a, b}, *nx[2] = {na, nb};
        const float *xs[2] = {xa, xb};
        float *ys[2] = {ya, yb};
        if (b != NULL)
            rows_bfp4(2, t, xs, nx, tc, ys);
        else
            rows_bfp4(1, t, xs, nx, tc, ys);
        return;
    }
    row32_avx512(a, tc, m, sc, xa, 0, na, ya);
    if (b != NULL) row32_avx512(b, tc, m, sc, xb, 0, nb, yb);
}
#else
#define Q4_FORM(m) 0
#ifdef DSF_AVX2
#define ROW32 row32_avx2
#else
#define ROW32 row32_generic
#endif
static inline void row_pair(int m, const float *sc, int tc, const uint8_t *a, const float *xa, const uint8_t *na,
                            float *ya, const uint8_t *b, const float *xb, const uint8_t *nb, float *yb) {
    (void)na, (void)nb;
    ROW32(a, tc, m, sc, xa, 0, ya);
    if (b != NULL) ROW32(b, tc, m, sc, xb, 0, yb);
}
#endif

/* 32 values -> the vector form row_pair reads, at the place of columns [32 ti, 32 ti + 32) */
static inline void put32(const float *v, int q4, int ti, float *vec) {
    if (q4) {
        put_q4(v, vec + (size_t)ti * 128);
        put_q4(v + 16, vec + (size_t)ti * 128 + 64);
    } else {
        memcpy(vec + (size_t)ti * 32, v, 32 * sizeof(float));
    }
}

/* One decode token through n routed experts, every one in a slot of the same layout (w1 and w3 [32 tr13, 32 tc13],
 * w2 [32 tr2, 32 tr13] at byte offsets off1 / off3 / off2 of its slot):
 *   y = sum over e = 0..n-1, in that order, of W2_e (wts[e] * swiglu(W1_e x, W3_e x))
 * with swiglu(g, u) = silu(min(g, limit)) * clamp(u, -limit, limit) (no clamp where limit <= 0), as
 * model.experts.swiglu computes it. One parallel region and one barrier for the whole layer where three kernel calls
 * and a handful of tensor operations per expert went before; each product has the bits of bfp_gemv's.
 * x: [32 tc13] fp32; y: [32 tr2] fp32; work: (tc13 + n tr13) * 128 floats of scratch. */
void bfp_moe_decode(const uint8_t *const *slots, int n, int m, int64_t off1, int64_t off3, int64_t off2, int tr13,
                    int tc13, int tr2, const float *x, const float *wts, float limit, float *work, float *y) {
    const int q4 = Q4_FORM(m);
    const size_t hlen = (size_t)tr13 * (q4 ? 128 : 32);
    float *xv = work, *h = work + (size_t)tc13 * 128;
    float sc[256];
    scales(m, sc);
    for (int tj = 0; tj < tc13; tj++) put32(x + (size_t)tj * 32, q4, tj, xv);
    const size_t tiles = (size_t)n * tr13 * (2 * tc13 + tr2);
    const size_t rb13 = (size_t)tc13 * tile_bytes(m), rb2 = (size_t)tr13 * tile_bytes(m);
#pragma omp parallel if (tiles > PARALLEL_TILES)
    {
#pragma omp for schedule(static)
        for (int it = 0; it < n * tr13; it++) {
            const int e = it / tr13, ti = it % tr13;
            float g[32], u[32], v[32];
            /* w1 and w3 row ti together (two streams), each prefetching its successor in this thread's share */
            const int e1 = (it + 1) / tr13, ti1 = (it + 1) % tr13;
            const uint8_t *n1 = e1 < n ? slots[e1] + off1 + ti1 * rb13 : NULL;
            const uint8_t *n3 = e1 < n ? slots[e1] + off3 + ti1 * rb13 : NULL;
            row_pair(m, sc, tc13, slots[e] + off1 + ti * rb13, xv, n1, g, slots[e] + off3 + ti * rb13, xv, n3, u);
            for (int r = 0; r < 32; r++) {
                float gr = g[r], ur = u[r];
                if (limit > 0) { /* comparisons, not fminf: a NaN stays NaN as in torch.clamp */
                    ur = ur < -limit ? -limit : (ur > limit ? limit : ur);
                    gr = gr > limit ? limit : gr;
                }
                v[r] = gr / (1.0f + expf(-gr)) * ur * wts[e];
            }
            put32(v, q4, ti, h + e * hlen);
        }
        /* the barrier: every expert's activation is complete before any w2 row reads it */
#pragma omp for schedule(static)
        for (int ti = 0; ti < tr2; ti++) {
            float acc[32], ta[32], tb[32];
            /* experts two at a time (two streams), added in routing order; each pair prefetches the next pair's
             * rows, the last pair experts 0 and 1's next row */
            for (int e = 0; e < n; e += 2) {
                const int two = e + 1 < n, last = e + 2 >= n;
                const uint8_t *na = last ? slots[0] + off2 + (ti + 1) * rb2 : slots[e + 2] + off2 + ti * rb2;
                const uint8_t *nb = last ? slots[n > 1 ? 1 : 0] + off2 + (ti + 1) * rb2
                                         : slots[e + 3 < n ? e + 3 : e + 2] + off2 + ti * rb2;
                row_pair(m, sc, tr13, slots[e] + off2 + ti * rb2, h + e * hlen, na, e == 0 ? acc : ta,
                         two ? slots[e + 1] + off2 + ti * rb2 : NULL, h + (e + 1) * hlen, nb, tb);
                if (e > 0)
                    for (int r = 0; r < 32; r++) acc[r] += ta[r];
                if (two)
                    for (int r = 0; r < 32; r++) acc[r] += tb[r];
            }
            memcpy(y + (size_t)ti * 32, acc, sizeof acc);
        }
    }
}

/* One tile row t (tc tiles) against K vectors xs (each in the form row_pair reads) -> 32 outputs at ys[k], a vector's
 * every output with the operations and order of the one-vector loop (bfp_gemv's nx = 1), so a token routed to an
 * expert beside others gets the bits it gets alone; a bfp4_b row is decoded once for up to four vectors. next: the
 * row read after this one (prefetched where the build prefetches). */
#ifdef __AVX512F__
static void row_vecs(int m, const float *sc, int tc, const uint8_t *t, const uint8_t *next, const float *const *xs,
                     float *const *ys, int K) {
    if (m != 3) { /* bfp8_b: the row again from L1/L2 for each further vector */
        for (int k = 0; k < K; k++) row32_avx512(t, tc, m, sc, xs[k], 0, k + 1 < K ? t : next, ys[k]);
        return;
    }
    for (int k0 = 0; k0 < K; k0 += 4) {
        const int kn = K - k0 < 4 ? K - k0 : 4;
        const uint8_t *nx = k0 + 4 < K ? t : next;
        if (kn == 4)
            rows_bfp4_vecs(t, nx, tc, xs + k0, ys + k0, 4);
        else if (kn == 3)
            rows_bfp4_vecs(t, nx, tc, xs + k0, ys + k0, 3);
        else if (kn == 2)
            rows_bfp4_vecs(t, nx, tc, xs + k0, ys + k0, 2);
        else
            rows_bfp4_vecs(t, nx, tc, xs + k0, ys + k0, 1);
    }
}
#elif defined(DSF_AVX2)
/* row32_avx2 / row32x2_avx2 / row32xk_avx2's row grouping (8, 4, 2 rows a pass for 1, 2, 3-4 vectors) on a row */
static inline __attribute__((always_inline)) void row32v_avx2(const uint8_t *row, int tc, int m, const float *sc,
                                                               const float *const *xs, float *const *ys,
                                                               const int K) {
    const int R = K == 1 ? 8 : (K == 2 ? 4 : 2), half = 16 / R;
    for (int q = 0; q < 2 * half; q++) {
        float *yq[4];
        for (int k = 0; k < K; k++) yq[k] = ys[k] + R * q;
        rows_avx2(row, tc, m, sc, xs, K, q / half, R * (q % half), R, yq);
    }
}
static void row_vecs(int m, const float *sc, int tc, const uint8_t *t, const uint8_t *next, const float *const *xs,
                     float *const *ys, int K) {
    (void)next;
    for (int k0 = 0; k0 < K; k0 += 4) {
        const int kn = K - k0 < 4 ? K - k0 : 4;
        if (kn == 4)
            row32v_avx2(t, tc, m, sc, xs + k0, ys + k0, 4);
        else if (kn == 3)
            row32v_avx2(t, tc, m, sc, xs + k0, ys + k0, 3);
        else if (kn == 2)
            row32v_avx2(t, tc, m, sc, xs + k0, ys + k0, 2);
        else
            row32v_avx2(t, tc, m, sc, xs + k0, ys + k0, 1);
    }
}
#else
static void row_vecs(int m, const float *sc, int tc, const uint8_t *t, const uint8_t *next, const float *const *xs,
                     float *const *ys, int K) {
    (void)next;
    for (int k = 0; k < K; k++) row32_generic(t, tc, m, sc, xs[k], 0, ys[k]);
}
#endif

/* B decode tokens (a batched decode step's, or a verify's few positions), token b through its own k routed experts:
 *   y[b] = sum over j = 0..k-1, in that order, of W2_{route[b, j]} (wts[b, j] * swiglu(W1 x_b, W3 x_b))
 * with the experts in nu slots of one layout (slots[u]; route indexes them). Each expert's tile rows are read once
 * for all the tokens routed to it, in one parallel region for the layer, and every product, activation and sum of a
 * token is bfp_moe_decode's for that token alone with its experts in route order: a token's result has the bits of
 * its own call whatever tokens run beside it. x: [B, 32 tc13]; y: [B, 32 tr2]; work: (B tc13 + B k tr13) * 128
 * floats of scratch. */
void bfp_moe_decode_batch(const uint8_t *const *slots, int nu, int m, int64_t off1, int64_t off3, int64_t off2,
                          int tr13, int tc13, int tr2, const float *x, int B, int k, const int *route,
                          const float *wts, float limit, float *work, float *y) {
    const int q4 = Q4_FORM(m), P = B * k;
    const size_t xlen = (size_t)tc13 * (q4 ? 128 : 32), hlen = (size_t)tr13 * (q4 ? 128 : 32);
    float *xv = work, *h = work + (size_t)B * xlen;
    float sc[256];
    scales(m, sc);
    for (int b = 0; b < B; b++)
        for (int tj = 0; tj < tc13; tj++) put32(x + ((size_t)b * tc13 + tj) * 32, q4, tj, xv + b * xlen);
    /* the (token, column) pairs p = b k + j of each expert, in token order: pairs[start[u] .. start[u + 1]) */
    int start[nu + 1], pairs[P > 0 ? P : 1], fill[nu > 0 ? nu : 1];
    memset(start, 0, sizeof start);
    for (int p = 0; p < P; p++) start[route[p] + 1]++;
    for (int u = 0; u < nu; u++) start[u + 1] += start[u], fill[u] = start[u];
    for (int p = 0; p < P; p++) pairs[fill[route[p]]++] = p;
    const size_t tiles = (size_t)nu * tr13 * (2 * tc13 + tr2);
    const size_t rb13 = (size_t)tc13 * tile_bytes(m), rb2 = (size_t)tr13 * tile_bytes(m);
#pragma omp parallel if (tiles > PARALLEL_TILES)
    {
#pragma omp for schedule(static)
        for (int it = 0; it < nu * tr13; it++) {
            const int u = it / tr13, ti = it % tr13;
            const uint8_t *w1 = slots[u] + off1 + ti * rb13, *w3 = slots[u] + off3 + ti * rb13;
            const int u1 = (it + 1) / tr13, ti1 = (it + 1) % tr13;
            const uint8_t *n1 = u1 < nu ? slots[u1] + off1 + ti1 * rb13 : NULL;
            const uint8_t *n3 = u1 < nu ? slots[u1] + off3 + ti1 * rb13 : NULL;
            for (int i0 = start[u]; i0 < start[u + 1]; i0 += 4) {
                const int kn = start[u + 1] - i0 < 4 ? start[u + 1] - i0 : 4;
                float g[4][32], up[4][32], v[32];
                const float *xs[4];
                float *gs[4], *us[4];
                for (int i = 0; i < kn; i++) xs[i] = xv + (pairs[i0 + i] / k) * xlen, gs[i] = g[i], us[i] = up[i];
                if (kn == 1) { /* one token: w1 and w3 rows as two streams, as bfp_moe_decode runs them */
                    row_pair(m, sc, tc13, w1, xs[0], n1, g[0], w3, xs[0], n3, up[0]);
                } else {
                    const int more = i0 + 4 < start[u + 1];
                    row_vecs(m, sc, tc13, w1, w3, xs, gs, kn);
                    row_vecs(m, sc, tc13, w3, more ? w1 : n1, xs, us, kn);
                }
                for (int i = 0; i < kn; i++) {
                    const int p = pairs[i0 + i];
                    for (int r = 0; r < 32; r++) { /* bfp_moe_decode's activation */
                        float gr = g[i][r], ur = up[i][r];
                        if (limit > 0) {
                            ur = ur < -limit ? -limit : (ur > limit ? limit : ur);
                            gr = gr > limit ? limit : gr;
                        }
                        v[r] = gr / (1.0f + expf(-gr)) * ur * wts[p];
                    }
                    put32(v, q4, ti, h + p * hlen);
                }
            }
        }
        /* the barrier: every pair's activation is complete before any w2 row reads it */
#pragma omp for schedule(static)
        for (int ti = 0; ti < tr2; ti++) {
            float o[P > 0 ? P : 1][32];
            int lone = -1; /* an expert's single token waiting for a second one to share two streams with */
            for (int u = 0; u < nu; u++) {
                const uint8_t *w2 = slots[u] + off2 + ti * rb2;
                const uint8_t *nx = u + 1 < nu ? slots[u + 1] + off2 + ti * rb2 : slots[0] + off2 + (ti + 1) * rb2;
                if (start[u + 1] - start[u] == 1) {
                    const int p = pairs[start[u]];
                    if (lone < 0) {
                        lone = u;
                        continue;
                    }
                    const int q = pairs[start[lone]];
                    row_pair(m, sc, tr13, slots[lone] + off2 + ti * rb2, h + q * hlen, w2, o[q], w2, h + p * hlen, nx,
                             o[p]);
                    lone = -1;
                    continue;
                }
                for (int i0 = start[u]; i0 < start[u + 1]; i0 += 4) {
                    const int kn = start[u + 1] - i0 < 4 ? start[u + 1] - i0 : 4;
                    const float *hs[4];
                    float *os[4];
                    for (int i = 0; i < kn; i++) hs[i] = h + pairs[i0 + i] * hlen, os[i] = o[pairs[i0 + i]];
                    row_vecs(m, sc, tr13, w2, i0 + 4 < start[u + 1] ? w2 : nx, hs, os, kn);
                }
            }
            if (lone >= 0) {
                const int q = pairs[start[lone]];
                row_pair(m, sc, tr13, slots[lone] + off2 + ti * rb2, h + q * hlen, slots[0] + off2 + (ti + 1) * rb2,
                         o[q], NULL, NULL, NULL, NULL);
            }
            for (int b = 0; b < B; b++) { /* bfp_moe_decode's sum: ((o0 + o1) + o2) + ... */
                float acc[32];
                memcpy(acc, o[b * k], sizeof acc);
                for (int j = 1; j < k; j++)
                    for (int r = 0; r < 32; r++) acc[r] += o[b * k + j][r];
                memcpy(y + (size_t)b * tr2 * 32 + (size_t)ti * 32, acc, sizeof acc);
            }
        }
    }
}

/* h[i, c] = swiglu(g[i, c], u[i, c]) * w[i] for rows i < n of `cols` values, with bfp_moe_decode's operations in
 * its order (silu as g / (1 + expf(-g)), libm's expf): an expert product outside the one-call decode (a batched
 * step's, a prefill's) then carries the bits of the same token's product inside it. */
void swiglu_rows(const float *g, const float *u, const float *w, int64_t n, int cols, float limit, float *h) {
    for (int64_t i = 0; i < n; i++)
        for (int c = 0; c < cols; c++) {
            float gr = g[i * cols + c], ur = u[i * cols + c];
            if (limit > 0) {
                ur = ur < -limit ? -limit : (ur > limit ? limit : ur);
                gr = gr > limit ? limit : gr;
            }
            h[i * cols + c] = gr / (1.0f + expf(-gr)) * ur * w[i];
        }
}

/* Store one decoded face row (16 values, already scaled) as fp32, or as bfloat16: its top half, exact since q has
 * at most 7 significant bits and the scale is a power of two. */
#ifdef __AVX512F__
static inline void store16(void *out, size_t at, int bf16, __m512 x) {
    if (bf16)
        _mm256_storeu_si256((__m256i *)((uint16_t *)out + at),
                            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16)));
    else
        _mm512_storeu_ps((float *)out + at, x);
}
#else
static inline void store16(void *out, size_t at, int bf16, const float *v) {
    for (int c = 0; c < 16; c++) {
        uint32_t b;
        memcpy(&b, &v[c], 4);
        if (bf16)
            ((uint16_t *)out)[at + c] = (uint16_t)(b >> 16);
        else
            ((float *)out)[at + c] = v[c];
    }
}
#endif

/* tiles [tj0, tj1) of tile row ti of W -> their 32 rows at out (row-major, `width` values apart; column 32 tj0 of W
 * at out's column 0), fp32 or bfloat16 (bf16 != 0) */
static void expand_tiles(const uint8_t *tiles, int tc, int m, const float *sc, int ti, int tj0, int tj1, void *out,
                         size_t width, int bf16) {
    const int tb = tile_bytes(m), fb = face_bytes(m), rb = row_bytes(m);
    float v[16];
    (void)v;
    for (int tj = tj0; tj < tj1; tj++) {
        const uint8_t *t = tiles + ((size_t)ti * tc + tj) * tb;
        for (int f = 0; f < 4; f++) {
            const uint8_t *d = t + 64 + f * fb;
            for (int r = 0; r < 16; r++) {
                size_t at = (size_t)((f >> 1) * 16 + r) * width + (tj - tj0) * 32 + (f & 1) * 16;
                float s = sc[t[16 * f + r]];
#ifdef __AVX512F__
                store16(out, at, bf16, _mm512_mul_ps(decode_row_avx512(d + r * rb, m), _mm512_set1_ps(s)));
#elif defined(DSF_AVX2)
                __m256 lo, hi;
                decode_row_avx2(d + r * rb, m, 1, &lo, &hi);
                lo = _mm256_mul_ps(lo, _mm256_set1_ps(s));
                hi = _mm256_mul_ps(hi, _mm256_set1_ps(s));
                if (bf16) {
                    store_bf16x16((uint16_t *)out + at, lo, hi);
                } else {
                    _mm256_storeu_ps((float *)out + at, lo);
                    _mm256_storeu_ps((float *)out + at + 8, hi);
                }
#else
                decode_row(d + r * rb, m, v);
                for (int c = 0; c < 16; c++) v[c] *= s;
                store16(out, at, bf16, v);
#endif
            }
        }
    }
}

/* tile row ti of W -> its 32 rows at out (row-major, leading dimension tc * 32) */
static void expand_tile_row(const uint8_t *tiles, int tc, int m, const float *sc, int ti, void *out, int bf16) {
    expand_tiles(tiles, tc, m, sc, ti, 0, tc, out, (size_t)tc * 32, bf16);
}

/* W rows of tile rows [tr0, tr1) -> row-major [tr*32, tc*32], fp32 or bfloat16 (bf16 != 0), for matrix products. */
void bfp_expand(const uint8_t *tiles, int tr, int tc, int m, void *out, int bf16, int tr0, int tr1) {
    const size_t panel = (size_t)32 * tc * 32 * (bf16 ? 2 : 4); /* bytes of one tile row's expansion */
    float sc[256];
    (void)tr;
    scales(m, sc);
#pragma omp parallel for schedule(static) if ((size_t)(tr1 - tr0) * tc > PARALLEL_TILES)
    for (int ti = tr0; ti < tr1; ti++) expand_tile_row(tiles, tc, m, sc, ti, (uint8_t *)out + ti * panel, bf16);
}

/* tile row ti of W -> 32 bfloat16 rows at out: one panel of a fused product (amx_linear_bfp) */
void bfp_panel_bf16(const uint8_t *tiles, int tc, int m, int ti, uint16_t *out) {
    float sc[256];
    scales(m, sc);
    expand_tile_row(tiles, tc, m, sc, ti, out, 1);
}

/* the 256 scales 2^(E - 127 - (m - 1)) of a format's exponents, for bfp_block_f32 */
void bfp_scale_table(int m, float *sc) { scales(m, sc); }

/* tiles [tj0, tj1) of tile row ti -> 32 fp32 rows of 32 (tj1 - tj0) values, ld apart: one k-block of a panel of a
 * fused fp32 product (packed_cpu.c); sc from bfp_scale_table */
void bfp_block_f32(const uint8_t *tiles, int tc, int m, const float *sc, int ti, int tj0, int tj1, float *out, int ld) {
    expand_tiles(tiles, tc, m, sc, ti, tj0, tj1, out, (size_t)ld, 0);
}
