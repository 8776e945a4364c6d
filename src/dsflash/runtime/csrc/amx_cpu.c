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
#if defined(__AMX_BF16__) && defined(__AVX512F__)
#include <immintrin.h>
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

/* x fp32 [M, K] -> xh then xl, each in VNNI tiles [Mp / 16][Kp / 32] (tile row kk: for 16 tokens m, the pair
 * x[m][2kk], x[m][2kk + 1]), zero past M and K */
void split_vnni(const float *x, int M, int K, uint16_t *xv, int Mp, int Kp) {
    const int kb = Kp / 32;
    const size_t part = (size_t)Mp * Kp;
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
}
