/* CPU kernels over Tenstorrent block-float tiles (bfp4_b / bfp8_b), the format of the expert slots.
 *
 * Layout (docs/bfp_format.md): 32x32 tiles in row-major tile order; a tile is 64 exponent bytes (face f, row r at
 * 16f + r) followed by the codes of faces 0..3 (face 0 = rows 0-15 x cols 0-15, 1 = rows 0-15 x cols 16-31,
 * 2 = rows 16-31 x cols 0-15, 3 = rows 16-31 x cols 16-31), each face 16 rows of 16 sign-magnitude codes.
 * value = (-1)^s * q * 2^(E - 127 - (m - 1)) with m = 3 (bfp4_b: nibbles, low nibble first) or 7 (bfp8_b: bytes).
 *
 * Built at first use with the system C compiler (-O3 -march=native -fopenmp) by runtime/native.py, which links
 * the OpenMP runtime torch already loaded, so these kernels share torch's thread team instead of fighting it.
 * The generic loops are the fallback the compiler vectorizes where AVX-512 is absent. */
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif

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

#ifdef __AVX512F__
/* The decode kernels do a few instructions per byte, and one core's hardware prefetcher alone keeps too few lines
 * in flight to feed them: asking for the tile a few tiles ahead took the bfp4_b GEMV from 11.7 to 15.1 GB/s and
 * bfp8_b's from 11.4 to 14.1 on 2 cores (fp8_gemv, four rows in flight, gained nothing from it). A prefetch past
 * the end of a matrix is a harmless hint. */
#define PREFETCH_AHEAD 4
#define PREFETCH_TILE(p, n)                                                                                            \
    for (int l_ = 0; l_ < (n); l_ += 64) _mm_prefetch((const char *)(p) + l_, _MM_HINT_T0)

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
static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* bfp4_b against one vector, two face rows per step. The 16 code bytes of rows r and r+1 widen to 16 lanes; the
 * LUT permute reads only an index's low 4 bits, so the low nibbles (even columns) and, after one shift, the high
 * nibbles (odd columns) decode without masking. x comes pre-split into even and odd columns (xeo: per 16-column
 * segment, 8 even values twice, then 8 odd values twice), so lanes 0-7 accumulate row r and lanes 8-15 row r+1.
 * Each face's partial sums take the rows' scales once, two table values broadcast from memory and merged (load
 * ports and a blend, where a lane permute of the face's scales competed with the decode's permutes for the one
 * shuffle port: 5-10 % faster, the same products). About half the instructions of the one-row loop above.
 * All 32 rows of a tile row accumulate at once (16 registers), so each tile is read once, whole: 15.1 -> 18-19.7
 * GB/s against two passes of 16 rows (the same operations per row in the same order: the same bits). */
static inline void row32_bfp4(const uint8_t *tiles, int tc, const float *sc, const float *xeo, int ti,
                              const uint8_t *next, float *y32) {
    const int tb = tile_bytes(3), fb = face_bytes(3);
    const __m512 lut = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, -0.0f, -1, -2, -3, -4, -5, -6, -7);
    __m512 acc[16];
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) acc[k] = _mm512_setzero_ps();
    for (int tj = 0; tj < tc; tj++) {
        const uint8_t *t = tiles + ((size_t)ti * tc + tj) * tb;
        PREFETCH_TILE(ahead(t, tj, tc, tb, next), tb);
#pragma GCC unroll 4
        for (int f = 0; f < 4; f++) {
            const int h = f >> 1, fc = f & 1;
            const float *xs = xeo + (size_t)(2 * tj + fc) * 32;
            const __m512 xe = _mm512_loadu_ps(xs), xo = _mm512_loadu_ps(xs + 16);
            const uint8_t *d = t + 64 + f * fb, *e = t + 16 * f;
#pragma GCC unroll 8
            for (int k = 0; k < 8; k++) {
                const __m512i w = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(d + 16 * k)));
                const __m512 lo = _mm512_permutexvar_ps(w, lut);
                const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(w, 4), lut);
                const __m512 p = _mm512_fmadd_ps(lo, xe, _mm512_mul_ps(hi, xo));
                const __m512 sr = _mm512_mask_mov_ps(_mm512_set1_ps(sc[e[2 * k]]), 0xFF00, _mm512_set1_ps(sc[e[2 * k + 1]]));
                acc[8 * h + k] = _mm512_fmadd_ps(p, sr, acc[8 * h + k]);
            }
        }
    }
#pragma GCC unroll 16
    for (int k = 0; k < 16; k++) {
        y32[2 * k] = hsum8(_mm512_castps512_ps256(acc[k]));
        y32[2 * k + 1] = hsum8(_mm512_extractf32x8_ps(acc[k], 1));
    }
}

static void gemv1_bfp4(const uint8_t *tiles, int tc, const float *sc, const float *xeo, float *y, int tr0, int tr1) {
#pragma omp parallel for schedule(static) if ((size_t)(tr1 - tr0) * tc > PARALLEL_TILES)
    for (int ti = tr0; ti < tr1; ti++) row32_bfp4(tiles, tc, sc, xeo, ti, NULL, y + ti * 32);
}

#endif

/* 16 columns of x -> the even / odd form gemv1_bfp4 reads: 8 even values twice, then 8 odd values twice */
static inline void split_eo(const float *x16, float *seg32) {
    for (int j = 0; j < 8; j++) {
        seg32[j] = seg32[8 + j] = x16[2 * j];
        seg32[16 + j] = seg32[24 + j] = x16[2 * j + 1];
    }
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
        float xeo[tc * 64];
        for (int s = 0; s < 2 * tc; s++) split_eo(x + s * 16, xeo + s * 32);
        gemv1_bfp4(tiles, tc, sc, xeo, y, tr0, tr1);
        return;
    }
    if (nx == 1) {
        gemv1_avx512(tiles, tc, m, sc, x, y, tr0, tr1);
        return;
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
#else
    for (int ti = tr0; ti < tr1; ti++)
        for (int k = 0; k < nx; k++) row32_generic(tiles, tc, m, sc, x + (size_t)k * in, ti, y + (size_t)k * out + ti * 32);
#endif
}

/* Tile row ti of W against one vector, the vector in the form the format's one-vector loop reads (bfp4_b on
 * AVX-512: the even / odd split, 64 floats per 32 columns; otherwise plain). Same operations as bfp_gemv, nx = 1. */
#ifdef __AVX512F__
#define EO_FORM(m) ((m) == 3)
static inline void row32(const uint8_t *tiles, int tc, int m, const float *sc, const float *xv, int ti,
                         const uint8_t *next, float *y32) {
    if (m == 3)
        row32_bfp4(tiles, tc, sc, xv, ti, next, y32);
    else
        row32_avx512(tiles, tc, m, sc, xv, ti, next, y32);
}
#else
#define EO_FORM(m) 0
static inline void row32(const uint8_t *tiles, int tc, int m, const float *sc, const float *xv, int ti,
                         const uint8_t *next, float *y32) {
    (void)next;
    row32_generic(tiles, tc, m, sc, xv, ti, y32);
}
#endif

/* 32 values -> the vector form row32 reads, at the place of columns [32 ti, 32 ti + 32) */
static inline void put32(const float *v, int eo, int ti, float *vec) {
    if (eo) {
        split_eo(v, vec + (size_t)ti * 64);
        split_eo(v + 16, vec + (size_t)ti * 64 + 32);
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
 * x: [32 tc13] fp32; y: [32 tr2] fp32; work: (tc13 + n tr13) * 64 floats of scratch. */
void bfp_moe_decode(const uint8_t *const *slots, int n, int m, int64_t off1, int64_t off3, int64_t off2, int tr13,
                    int tc13, int tr2, const float *x, const float *wts, float limit, float *work, float *y) {
    const int eo = EO_FORM(m);
    const size_t hlen = (size_t)tr13 * (eo ? 64 : 32);
    float *xv = work, *h = work + (size_t)tc13 * 64;
    float sc[256];
    scales(m, sc);
    for (int tj = 0; tj < tc13; tj++) put32(x + (size_t)tj * 32, eo, tj, xv);
    const size_t tiles = (size_t)n * tr13 * (2 * tc13 + tr2);
#pragma omp parallel if (tiles > PARALLEL_TILES)
    {
#pragma omp for schedule(static)
        for (int it = 0; it < n * tr13; it++) {
            const int e = it / tr13, ti = it % tr13;
            float g[32], u[32], v[32];
            /* rows read in the order w1 ti, w3 ti, then the next (expert, ti) of this thread's share */
            const int e1 = (it + 1) / tr13, ti1 = (it + 1) % tr13;
            const size_t rb13 = (size_t)tc13 * tile_bytes(m);
            row32(slots[e] + off1, tc13, m, sc, xv, ti, slots[e] + off3 + ti * rb13, g);
            row32(slots[e] + off3, tc13, m, sc, xv, ti, e1 < n ? slots[e1] + off1 + ti1 * rb13 : NULL, u);
            for (int r = 0; r < 32; r++) {
                float gr = g[r], ur = u[r];
                if (limit > 0) { /* comparisons, not fminf: a NaN stays NaN as in torch.clamp */
                    ur = ur < -limit ? -limit : (ur > limit ? limit : ur);
                    gr = gr > limit ? limit : gr;
                }
                v[r] = gr / (1.0f + expf(-gr)) * ur * wts[e];
            }
            put32(v, eo, ti, h + e * hlen);
        }
        /* the barrier: every expert's activation is complete before any w2 row reads it */
#pragma omp for schedule(static)
        for (int ti = 0; ti < tr2; ti++) {
            float acc[32], t[32];
            const size_t rb2 = (size_t)tr13 * tile_bytes(m);
            /* each expert's row ti, then the next expert's (the last: expert 0's next row) */
            row32(slots[0] + off2, tr13, m, sc, h, ti, n > 1 ? slots[1] + off2 + ti * rb2 : NULL, acc);
            for (int e = 1; e < n; e++) {
                const uint8_t *nx = e + 1 < n ? slots[e + 1] + off2 + ti * rb2 : slots[0] + off2 + (ti + 1) * rb2;
                row32(slots[e] + off2, tr13, m, sc, h + e * hlen, ti, nx, t);
                for (int r = 0; r < 32; r++) acc[r] += t[r];
            }
            memcpy(y + (size_t)ti * 32, acc, sizeof acc);
        }
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

/* tile row ti of W -> its 32 rows at out (row-major, leading dimension tc * 32), fp32 or bfloat16 (bf16 != 0) */
static void expand_tile_row(const uint8_t *tiles, int tc, int m, const float *sc, int ti, void *out, int bf16) {
    const int tb = tile_bytes(m), fb = face_bytes(m), rb = row_bytes(m);
    const size_t width = (size_t)tc * 32;
    float v[16];
    (void)v;
    for (int tj = 0; tj < tc; tj++) {
        const uint8_t *t = tiles + ((size_t)ti * tc + tj) * tb;
        for (int f = 0; f < 4; f++) {
            const uint8_t *d = t + 64 + f * fb;
            for (int r = 0; r < 16; r++) {
                size_t at = (size_t)((f >> 1) * 16 + r) * width + tj * 32 + (f & 1) * 16;
                float s = sc[t[16 * f + r]];
#ifdef __AVX512F__
                store16(out, at, bf16, _mm512_mul_ps(decode_row_avx512(d + r * rb, m), _mm512_set1_ps(s)));
#else
                decode_row(d + r * rb, m, v);
                for (int c = 0; c < 16; c++) v[c] *= s;
                store16(out, at, bf16, v);
#endif
            }
        }
    }
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
