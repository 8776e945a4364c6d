/* Prefill products on the CPU's matrix units (AMX, bf16 in, fp32 accumulate), with fp32-grade activations:
 * x = xh + xl, both bfloat16 (xh = bf16(x), xl = bf16(x - xh)), so y = W xh + W xl carries about 16 significant
 * bits of x instead of bf16's 8. W is exact in bf16 (block-float, FP8 and bf16 weights all are). Every output
 * element sums its products in one fixed order, k-block by k-block, whatever the matrix's height, the tokens'
 * count or the threads: a tensor-parallel shard computes its rows exactly as TP 1 does.
 *
 * The product is computed transposed, y^T = W x^T: W is then AMX's left operand, which it takes row-major, i.e.
 * exactly as the expansion kernels write it; only the (small) activations go into AMX's pair-interleaved "VNNI"
 * layout. Without AMX (or without the kernel's permission to use it) amx_ready() is 0 and the engine multiplies
 * in fp32 instead. */
#define _GNU_SOURCE /* syscall() */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#if defined(__AMX_BF16__) && defined(__AVX512F__)
#include <sys/syscall.h>
#include <unistd.h>
#define HAVE_AMX 1
#endif

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

int amx_ready(void) {
#ifdef HAVE_AMX
    static int state = -1; /* the permission is per process: asked once */
    if (state < 0) state = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return state;
#else
    return 0;
#endif
}

#ifdef HAVE_AMX
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tilecfg;

static void tiles_on(void) {
    tilecfg c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
}

#endif

#ifdef HAVE_AMX
/* The products of one 32-row panel of W (a0: its rows 0-15, a1: rows 16-31, row-major bf16, ldw bytes apart) with
 * every 32-token block of xv, into y's columns 32 np .. 32 np + 31. c: 256 floats of scratch. */
static void panel(const uint16_t *a0, const uint16_t *a1, size_t ldw, int kb, const uint16_t *xv, int Mp, int M, int N,
                  int np, float *y, float *c) {
    const size_t part = (size_t)Mp * kb * 32; /* xl follows xh */
    for (int mp = 0; mp < Mp / 32; mp++) { /* the panel stays in L2 across token blocks */
        const uint16_t *b0 = xv + (size_t)(2 * mp) * kb * 512, *b1 = b0 + (size_t)kb * 512;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int k = 0; k < kb; k++) {
            _tile_loadd(4, a0 + 32 * k, ldw);
            _tile_loadd(5, a1 + 32 * k, ldw);
            _tile_loadd(6, b0 + (size_t)k * 512, 64);
            _tile_loadd(7, b1 + (size_t)k * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            _tile_loadd(6, b0 + part + (size_t)k * 512, 64);
            _tile_loadd(7, b1 + part + (size_t)k * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        /* tile T holds y^T for rows n0 + r, tokens m0 + j */
#define OUT(T, dn, dm)                                                                                    \
    _tile_stored(T, c, 64);                                                                               \
    for (int r = 0; r < 16 && 32 * np + 16 * dn + r < N; r++)                                             \
        for (int j = 0; j < 16 && 32 * mp + 16 * dm + j < M; j++)                                         \
            y[(size_t)(32 * mp + 16 * dm + j) * N + 32 * np + 16 * dn + r] = c[16 * r + j];
        OUT(0, 0, 0)
        OUT(1, 0, 1)
        OUT(2, 1, 0)
        OUT(3, 1, 1)
#undef OUT
    }
}
#endif

/* y[m, n] = sum_k W[n, k] (xh[m, k] + xl[m, k]) for m < M, n < N. W: bf16 [Np, Kp] row-major (Np, Kp multiples of
 * 32; rows past N and columns past K zero); xv: the activations from split_vnni; y: fp32 [M, N]. */
void amx_linear(const uint16_t *w, int Np, int Kp, const uint16_t *xv, int Mp, int M, int N, float *y) {
#ifdef HAVE_AMX
    if (!amx_ready()) return; /* tiles used without the kernel's permission fault (SIGILL) */
#pragma omp parallel
    {
        tiles_on();
        float c[16 * 16];
#pragma omp for schedule(static)
        for (int np = 0; np < Np / 32; np++) {
            const uint16_t *a0 = w + (size_t)32 * np * Kp;
            panel(a0, a0 + (size_t)16 * Kp, (size_t)Kp * 2, Kp / 32, xv, Mp, M, N, np, y, c);
        }
        _tile_release();
    }
#else
    (void)w, (void)Np, (void)Kp, (void)xv, (void)Mp, (void)M, (void)N, (void)y;
#endif
}

/* the panel decoders of bfp_cpu.c and dense_cpu.c */
void bfp_panel_bf16(const uint8_t *tiles, int tc, int m, int ti, uint16_t *out);
void fp8_panel_bf16(const uint8_t *w, const float *scale, int O, int I, int B, int r0, uint16_t *out);

/* amx_linear on a packed W, each thread expanding one 32-row panel at a time into its own buffer (which stays in
 * L2) instead of the whole matrix through memory first: the same products in the same order, so the same bits.
 * fmt 0: FP8 w [N, K] (K a multiple of 32) with scales x 256 of B x B blocks; fmt 3 / 7: bfp4_b / bfp8_b tiles of
 * [N, K] (both multiples of 32). Returns 0 when it could not run (no AMX, or no memory for the panels). */
int amx_linear_packed(int fmt, const uint8_t *w, const float *scale, int B, int N, int K, const uint16_t *xv, int Mp,
                      int M, float *y) {
#ifdef HAVE_AMX
    if (!amx_ready() || K % 32 || (fmt && N % 32)) return 0;
    int failed = 0;
#pragma omp parallel
    {
        uint16_t *buf = aligned_alloc(64, (size_t)32 * K * 2);
        float c[16 * 16];
        if (buf) tiles_on();
#pragma omp atomic
        failed += buf == NULL;
#pragma omp barrier
#pragma omp for schedule(static)
        for (int np = 0; np < (N + 31) / 32; np++) {
            if (failed) continue;
            if (fmt)
                bfp_panel_bf16(w, K / 32, fmt, np, buf);
            else
                fp8_panel_bf16(w, scale, N, K, B, 32 * np, buf);
            panel(buf, buf + (size_t)16 * K, (size_t)K * 2, K / 32, xv, Mp, M, N, np, y, c);
        }
        if (buf) {
            _tile_release();
            free(buf);
        }
    }
    return !failed;
#else
    (void)fmt, (void)w, (void)scale, (void)B, (void)N, (void)K, (void)xv, (void)Mp, (void)M, (void)y;
    return 0;
#endif
}

/* round to nearest even, as torch's fp32 -> bf16 */
static inline uint16_t bf16_rne(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7F800000u) == 0x7F800000u) return (uint16_t)((b >> 16) | ((b & 0xFFFF) ? 0x40 : 0)); /* inf/nan */
    return (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

#ifdef __AVX512F__
/* bf16_rne on 16 lanes (integer rounding, so denormals round as the scalar version does, not flushed) */
static inline __m512i bf16_rne16(__m512i b) {
    const __m512i inf = _mm512_set1_epi32(0x7F800000);
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(_mm512_add_epi32(b, _mm512_set1_epi32(0x7FFF)),
                         _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1))),
        16);
    const __mmask16 special = _mm512_cmpeq_epi32_mask(_mm512_and_si512(b, inf), inf);
    const __mmask16 payload = _mm512_test_epi32_mask(b, _mm512_set1_epi32(0xFFFF));
    __m512i s = _mm512_srli_epi32(b, 16);
    s = _mm512_mask_or_epi32(s, payload, s, _mm512_set1_epi32(0x40));
    return _mm512_mask_mov_epi32(r, special, s);
}

/* 16 x 16 dwords: out[j] lane r = in[r] lane j */
static inline void transpose16(__m512i *v) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    /* v[4q + c] holds, per 128-bit lane L, rows 4q..4q+3 of column 4L + c; gather the lanes of four rows' groups */
    for (int c = 0; c < 4; c++) {
        const __m512i a = v[c], b = v[4 + c], d = v[8 + c], e = v[12 + c];
        const __m512i ab_lo = _mm512_shuffle_i32x4(a, b, 0x88), ab_hi = _mm512_shuffle_i32x4(a, b, 0xDD);
        const __m512i de_lo = _mm512_shuffle_i32x4(d, e, 0x88), de_hi = _mm512_shuffle_i32x4(d, e, 0xDD);
        t[c] = _mm512_shuffle_i32x4(ab_lo, de_lo, 0x88);      /* column c */
        t[8 + c] = _mm512_shuffle_i32x4(ab_lo, de_lo, 0xDD);  /* column 8 + c */
        t[4 + c] = _mm512_shuffle_i32x4(ab_hi, de_hi, 0x88);  /* column 4 + c */
        t[12 + c] = _mm512_shuffle_i32x4(ab_hi, de_hi, 0xDD); /* column 12 + c */
    }
    for (int i = 0; i < 16; i++) v[i] = t[i];
}

/* one 16-token x 32-column block: both terms, pairs of columns as dwords, transposed into the tile rows */
static void split_block(const float *x, int M, int K, int m0, int k0, uint16_t *hi_out, uint16_t *lo_out) {
    /* the low 16-bit halves of two 16-dword vectors, in order: 32 words */
    const __m512i lows = _mm512_set_epi16(62, 60, 58, 56, 54, 52, 50, 48, 46, 44, 42, 40, 38, 36, 34, 32, 30, 28, 26,
                                          24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i expmask = _mm512_set1_epi32(0x7F800000);
    const int n = K - k0 < 32 ? K - k0 : 32;
    const __mmask16 k_a = n >= 16 ? 0xFFFF : (__mmask16)((1u << n) - 1);
    const __mmask16 k_b = n <= 16 ? 0 : n >= 32 ? 0xFFFF : (__mmask16)((1u << (n - 16)) - 1);
    __m512i h[16], l[16];
    for (int r = 0; r < 16; r++) {
        if (m0 + r >= M) {
            h[r] = l[r] = _mm512_setzero_si512();
            continue;
        }
        const float *row = x + (size_t)(m0 + r) * K + k0;
        const __m512i a = _mm512_castps_si512(_mm512_maskz_loadu_ps(k_a, row));
        const __m512i b = _mm512_castps_si512(_mm512_maskz_loadu_ps(k_b, row + 16));
        const __m512i ha = bf16_rne16(a), hb = bf16_rne16(b);
        /* xl = bf16(x - float(xh)), 0 where x is not finite */
        const __m512 ra = _mm512_sub_ps(_mm512_castsi512_ps(a), _mm512_castsi512_ps(_mm512_slli_epi32(ha, 16)));
        const __m512 rb = _mm512_sub_ps(_mm512_castsi512_ps(b), _mm512_castsi512_ps(_mm512_slli_epi32(hb, 16)));
        const __mmask16 fa = _mm512_cmpneq_epi32_mask(_mm512_and_si512(a, expmask), expmask);
        const __mmask16 fb = _mm512_cmpneq_epi32_mask(_mm512_and_si512(b, expmask), expmask);
        const __m512i la = _mm512_maskz_mov_epi32(fa, bf16_rne16(_mm512_castps_si512(ra)));
        const __m512i lb = _mm512_maskz_mov_epi32(fb, bf16_rne16(_mm512_castps_si512(rb)));
        h[r] = _mm512_permutex2var_epi16(ha, lows, hb);
        l[r] = _mm512_permutex2var_epi16(la, lows, lb);
    }
    transpose16(h);
    transpose16(l);
    for (int j = 0; j < 16; j++) {
        _mm512_storeu_si512(hi_out + j * 32, h[j]);
        _mm512_storeu_si512(lo_out + j * 32, l[j]);
    }
}
#endif

/* x fp32 [M, K] -> xh then xl, each in VNNI tiles [Mp / 16][Kp / 32] (tile row kk: for 16 tokens m, the pair
 * x[m][2kk], x[m][2kk + 1]), zero past M and K */
void split_vnni(const float *x, int M, int K, uint16_t *xv, int Mp, int Kp) {
    const int kb = Kp / 32;
    const size_t part = (size_t)Mp * Kp;
#ifdef __AVX512F__
    /* 16 x 32 blocks: rows past M and columns past K (up to Kp) come out zero */
#pragma omp parallel for schedule(static) collapse(2) if ((size_t)M * K > (1 << 16))
    for (int mb = 0; mb < Mp / 16; mb++)
        for (int b = 0; b < kb; b++) {
            const size_t at = ((size_t)mb * kb + b) * 512;
            if (32 * b >= K || 16 * mb >= M) {
                memset(xv + at, 0, 1024);
                memset(xv + part + at, 0, 1024);
            } else {
                split_block(x, M, K, 16 * mb, 32 * b, xv + at, xv + part + at);
            }
        }
#else
    memset(xv, 0, 2 * part * 2);
#pragma omp parallel for schedule(static) if ((size_t)M * K > (1 << 16))
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) {
            const float v = x[(size_t)m * K + k];
            const uint16_t h = bf16_rne(v);
            const uint32_t hb = (uint32_t)h << 16;
            float hf;
            memcpy(&hf, &hb, 4);
            const size_t at = ((size_t)(m / 16) * kb + k / 32) * 512 + ((k % 32) / 2) * 32 + (m % 16) * 2 + (k % 2);
            xv[at] = h;
            xv[part + at] = isfinite(v) ? bf16_rne(v - hf) : 0;
        }
#endif
}
