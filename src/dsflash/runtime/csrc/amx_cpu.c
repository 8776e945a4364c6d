/* Prefill products on the CPU's matrix units (AMX, bf16 in, fp32 accumulate), with fp32-grade activations:
 * x = xh + xl, both bfloat16 (xh = bf16(x), xl = bf16(x - xh)), so y = W xh + W xl carries about 16 significant
 * bits of x instead of bf16's 8. W is exact in bf16 (block-float, FP8 and bf16 weights all are). Every output
 * element sums its products in one fixed order, k-block by k-block, whatever the matrix's height, the tokens'
 * count or the threads: a tensor-parallel shard computes its rows exactly as TP 1 does.
 *
 * W goes in AMX's "VNNI" tile layout: for each 16-row x 32-column block, a 1 KiB tile whose row kk holds, for
 * the 16 rows n, the pair W[n][2kk], W[n][2kk+1]. The expansions below write it straight from the stored format
 * (a face row or an FP8 row at a time through a small block in L1), never through a row-major copy.
 * Built with the other kernels; without AMX (or without the kernel's permission to use it) amx_ready() is 0 and
 * the engine multiplies in fp32 instead. */
#define _GNU_SOURCE /* syscall() */
#include <math.h>
#include <stdint.h>
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

/* a 16 x 32 bf16 block (row n at 32 n) -> one VNNI tile: a 16 x 16 transpose of 32-bit pairs (the block is in
 * L1: one gather per tile row) */
void vnni_tile(const uint16_t *blk, uint16_t *tile) {
#ifdef HAVE_AMX
    const __m512i idx = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240);
    for (int kk = 0; kk < 16; kk++)
        _mm512_storeu_si512((void *)(tile + 32 * kk),
                            _mm512_i32gather_epi32(_mm512_add_epi32(idx, _mm512_set1_epi32(kk)), blk, 4));
#else
    for (int kk = 0; kk < 16; kk++)
        for (int n = 0; n < 16; n++) memcpy(tile + 32 * kk + 2 * n, blk + 32 * n + 2 * kk, 4);
#endif
}

/* y[m, n] = sum_k W[n, k] (xh[m, k] + xl[m, k]) for n < N. xh, xl: bf16 [Mp, Kp], Mp a multiple of 32, Kp of 32,
 * zero-padded; wv: VNNI tiles [Np / 16][Kp / 32], Np a multiple of 32; y: fp32 [Mp, N] (ld N). */
void amx_linear(const uint16_t *xh, const uint16_t *xl, int Mp, int Kp, const uint16_t *wv, int Np, int N, float *y) {
#ifdef HAVE_AMX
    if (!amx_ready()) return; /* tiles used without the kernel's permission fault (SIGILL) */
    const int kb = Kp / 32, mpairs = Mp / 32, npairs = Np / 32;
    const size_t lda = (size_t)Kp * 2;
#pragma omp parallel
    {
        tiles_on();
        float c[16 * 16];
#pragma omp for schedule(static)
        for (int job = 0; job < mpairs * npairs; job++) {
            const int m = 32 * (job % mpairs), nb = 2 * (job / mpairs);
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            const uint16_t *b0 = wv + (size_t)nb * kb * 512, *b1 = b0 + (size_t)kb * 512;
            const uint16_t *h0 = xh + (size_t)m * Kp, *h1 = h0 + (size_t)16 * Kp;
            const uint16_t *l0 = xl + (size_t)m * Kp, *l1 = l0 + (size_t)16 * Kp;
            for (int k = 0; k < kb; k++) {
                _tile_loadd(6, b0 + (size_t)k * 512, 64);
                _tile_loadd(7, b1 + (size_t)k * 512, 64);
                _tile_loadd(4, h0 + 32 * k, lda);
                _tile_loadd(5, h1 + 32 * k, lda);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
                _tile_loadd(4, l0 + 32 * k, lda);
                _tile_loadd(5, l1 + 32 * k, lda);
                _tile_dpbf16ps(0, 4, 6);
                _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
#define OUT(T, dm, dn)                                                                        \
    _tile_stored(T, c, 64);                                                                   \
    for (int r = 0; r < 16; r++)                                                              \
        for (int j = 0; j < 16 && 16 * (nb + dn) + j < N; j++)                                \
            y[(size_t)(m + 16 * dm + r) * N + 16 * (nb + dn) + j] = c[16 * r + j];
            OUT(0, 0, 0)
            OUT(1, 0, 1)
            OUT(2, 1, 0)
            OUT(3, 1, 1)
#undef OUT
        }
        _tile_release();
    }
#else
    (void)xh, (void)xl, (void)Mp, (void)Kp, (void)wv, (void)Np, (void)N, (void)y;
#endif
}

/* x fp32 [M, K] -> xh, xl bf16 [Mp, Kp] (zero padding), round to nearest even as torch does */
static inline uint16_t bf16_rne(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7F800000u) == 0x7F800000u) return (uint16_t)((b >> 16) | ((b & 0xFFFF) ? 0x40 : 0)); /* inf/nan */
    return (uint16_t)((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

void split_bf16(const float *x, int M, int K, uint16_t *xh, uint16_t *xl, int Mp, int Kp) {
    memset(xh, 0, (size_t)Mp * Kp * 2);
    memset(xl, 0, (size_t)Mp * Kp * 2);
    for (int m = 0; m < M; m++)
        for (int k = 0; k < K; k++) {
            float v = x[(size_t)m * K + k];
            uint16_t h = bf16_rne(v);
            uint32_t hb = (uint32_t)h << 16;
            float hf;
            memcpy(&hf, &hb, 4);
            xh[(size_t)m * Kp + k] = h;
            xl[(size_t)m * Kp + k] = isfinite(v) ? bf16_rne(v - hf) : 0;
        }
}

/* bfloat16 [O, I] -> VNNI tiles [Np / 16][Kp / 32], zero-padded past O and I */
void bf16_vnni(const uint16_t *w, int O, int I, uint16_t *out, int Np, int Kp) {
    const int kb = Kp / 32;
#pragma omp parallel for schedule(static) if ((size_t)Np * Kp > (1 << 18))
    for (int n0 = 0; n0 < Np; n0 += 16) {
        uint16_t blk[16 * 32];
        for (int k0 = 0; k0 < Kp; k0 += 32) {
            memset(blk, 0, sizeof blk);
            const int w32 = I - k0 < 32 ? I - k0 : 32;
            for (int r = 0; r < 16 && n0 + r < O; r++)
                if (w32 > 0) memcpy(blk + 32 * r, w + (size_t)(n0 + r) * I + k0, (size_t)w32 * 2);
            vnni_tile(blk, out + ((size_t)(n0 / 16) * kb + k0 / 32) * 512);
        }
    }
}
