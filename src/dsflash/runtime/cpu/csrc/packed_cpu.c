/* fp32 prefill products on packed weights for CPUs without AMX (AVX2 + FMA, or AVX-512 F): y = x W^T with W's
 * panels (bfp4_b / bfp8_b tiles, FP8 blocks, bf16 rows) expanded to fp32 into a small per-thread buffer right where
 * they are multiplied, never the whole matrix through memory.
 *
 * Rounding: W is exact in fp32; every output element is one chain of fused multiply-adds over k = 0 .. K-1 in order
 * (one vector lane per token), so its bits depend neither on the matrix's height, the tokens' count, the vector
 * width nor the threads: a TP shard's rows are TP 1's rows, and the AVX2 and AVX-512 builds agree bit for bit.
 *
 * Blocking: threads take 32-row panels of W; a panel is expanded KC columns at a time (32 x KC fp32 in L1/L2), and
 * a register-blocked micro-kernel (R rows x V vectors of tokens) runs over the k-block with the activations packed
 * token-vector-major (xp), so both its operands stream from L1. The panel's partial sums wait in a per-thread
 * buffer (cb, [32][Mp]) between k-blocks, then are written to y transposed. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "simd.h"

#if defined(__AVX512F__)
#include <immintrin.h>
#define PK_LANES 16
#define PK_R 8 /* 32 registers: 8 x 3 accumulators, 3 token vectors, one broadcast */
typedef __m512 pk_vec;
#define PK_LOAD _mm512_loadu_ps
#define PK_STORE _mm512_storeu_ps
#define PK_ZERO _mm512_setzero_ps
#define PK_FMA _mm512_fmadd_ps
#define PK_ADD _mm512_add_ps
#define PK_BCAST _mm512_set1_ps
#elif defined(DSF_AVX2)
#define PK_LANES 8
#define PK_R 4 /* 16 registers: 4 x 3 accumulators, 3 token vectors, one broadcast */
typedef __m256 pk_vec;
#define PK_LOAD _mm256_loadu_ps
#define PK_STORE _mm256_storeu_ps
#define PK_ZERO _mm256_setzero_ps
#define PK_FMA _mm256_fmadd_ps
#define PK_ADD _mm256_add_ps
#define PK_BCAST _mm256_set1_ps
#endif

#define PK_V 3    /* token vectors per micro-kernel */
#define PK_KC 256 /* columns of W per expanded block: 32 KB of fp32 per panel */

/* the block decoders of bfp_cpu.c and dense_cpu.c */
void bfp_scale_table(int m, float *sc);
void bfp_block_f32(const uint8_t *tiles, int tc, int m, const float *sc, int ti, int tj0, int tj1, float *out, int ld);
void fp8_block_f32(const uint8_t *w, const float *scale, int O, int I, int B, int r0, int c0, int c1, float *out,
                   int ld);

/* 1 where this build has the fused product (f32_linear_packed runs), 0 where the caller expands instead */
int f32_packed_ready(void) {
#ifdef PK_LANES
    return 1;
#else
    return 0;
#endif
}

#ifdef PK_LANES
/* x fp32 [M, K] -> xp [Mp / L][K][L] (token-vector-major), zero past M */
static void pack_x(const float *x, int M, int K, float *xp, int Mp) {
    const int L = PK_LANES;
#pragma omp for schedule(static)
    for (int mb = 0; mb < Mp / L; mb++) {
        float *dst = xp + (size_t)mb * K * L;
        const int rows = M - mb * L < L ? M - mb * L : L;
        if (rows < L) memset(dst, 0, (size_t)K * L * 4);
        for (int k0 = 0; k0 < K; k0 += 64) { /* 64 columns at a time: the L source rows stay in L1 */
            const int k1 = k0 + 64 < K ? k0 + 64 : K;
            for (int l = 0; l < rows; l++) {
                const float *src = x + (size_t)(mb * L + l) * K;
                for (int k = k0; k < k1; k++) dst[(size_t)k * L + l] = src[k];
            }
        }
    }
}

/* One k-block's products for rows r < PK_R of the expanded block w (ldw apart) and V token vectors (xs apart) from
 * xv: each sum starts at zero and runs over k < kn in order, then lands in c (rows ldc apart, V vectors each), added
 * to what earlier k-blocks left there unless first. Two levels (within a block, then blocks in order) keep the
 * error near a blocked BLAS's rather than a 5120-term chain's. */
static inline __attribute__((always_inline)) void micro(const int V, const float *w, int ldw, const float *xv,
                                                         size_t xs, int kn, float *c, size_t ldc, int first) {
    pk_vec acc[PK_R][PK_V];
    for (int r = 0; r < PK_R; r++)
        for (int v = 0; v < V; v++) acc[r][v] = PK_ZERO();
    for (int k = 0; k < kn; k++) {
        pk_vec xk[PK_V];
        for (int v = 0; v < V; v++) {
            xk[v] = PK_LOAD(xv + v * xs + (size_t)k * PK_LANES);
            __asm__("" : "+x"(xk[v])); /* one load per vector, not one per FMA (the load ports are the limit) */
        }
        for (int r = 0; r < PK_R; r++) {
            const pk_vec b = PK_BCAST(w[r * ldw + k]);
            for (int v = 0; v < V; v++) acc[r][v] = PK_FMA(xk[v], b, acc[r][v]);
        }
    }
    for (int r = 0; r < PK_R; r++)
        for (int v = 0; v < V; v++) {
            float *at = c + r * ldc + v * PK_LANES;
            PK_STORE(at, first ? acc[r][v] : PK_ADD(PK_LOAD(at), acc[r][v]));
        }
}

/* bf16 rows [r0, r0 + 32) x columns [c0, c1) -> fp32 (exact), ld apart, rows past O zero */
static void bf16_block_f32(const uint16_t *w, int O, int I, int r0, int c0, int c1, float *out, int ld) {
    for (int o = r0; o < r0 + 32; o++) {
        float *dst = out + (size_t)(o - r0) * ld;
        if (o >= O) {
            memset(dst, 0, (size_t)(c1 - c0) * 4);
            continue;
        }
        const uint16_t *src = w + (size_t)o * I;
        for (int c = c0; c < c1; c++) {
            const uint32_t b = (uint32_t)src[c] << 16;
            memcpy(dst + (c - c0), &b, 4);
        }
    }
}
#endif

/* y [M, N] = x [M, K] W^T, fp32, for packed W [N, K]: fmt 0 FP8 (uint8 [N, K], fp32 scales x 256 of B x B blocks),
 * 1 bf16 rows, 3 / 7 bfp4_b / bfp8_b tiles (N, K multiples of 32). xp: scratch of Mp K floats, Mp = M rounded up to
 * f32_packed_lanes(). Returns 0 when it could not run (no vector build, no memory for the buffers). */
int f32_linear_packed(int fmt, const void *w, const float *scale, int B, int N, int K, const float *x, int M, float *xp,
                      float *y) {
#ifdef PK_LANES
    const int L = PK_LANES, Mp = (M + L - 1) / L * L, nv = Mp / L;
    const int kc = fmt == 0 && B > 0 ? (PK_KC + B - 1) / B * B : PK_KC; /* k-blocks follow FP8's scale blocks */
    if (fmt >= 3 && (N % 32 || K % 32)) return 0;
    int failed = 0;
    float sc[256];
    if (fmt >= 3) bfp_scale_table(fmt, sc);
#pragma omp parallel
    {
        float *wb = aligned_alloc(64, (size_t)32 * kc * 4), *cb = aligned_alloc(64, (size_t)32 * Mp * 4);
#pragma omp atomic
        failed += wb == NULL || cb == NULL;
        pack_x(x, M, K, xp, Mp); /* its omp for ends in a barrier: xp is whole before any panel reads it */
#pragma omp for schedule(static)
        for (int np = 0; np < (N + 31) / 32; np++) {
            if (failed) continue;
            const int rows = N - 32 * np < 32 ? N - 32 * np : 32;
            for (int k0 = 0; k0 < K; k0 += kc) {
                const int k1 = k0 + kc < K ? k0 + kc : K, kn = k1 - k0;
                if (fmt == 0)
                    fp8_block_f32(w, scale, N, K, B, 32 * np, k0, k1, wb, kc);
                else if (fmt == 1)
                    bf16_block_f32(w, N, K, 32 * np, k0, k1, wb, kc);
                else
                    bfp_block_f32(w, K / 32, fmt, sc, np, k0 / 32, k1 / 32, wb, kc);
                for (int v0 = 0; v0 < nv; v0 += PK_V) {
                    const float *xv = xp + ((size_t)v0 * K + k0) * L;
                    const size_t xs = (size_t)K * L;
                    for (int g = 0; g < rows; g += PK_R) {
                        float *c = cb + (size_t)g * Mp + (size_t)v0 * L;
                        const float *wg = wb + (size_t)g * kc;
                        switch (nv - v0 < PK_V ? nv - v0 : PK_V) {
                        case 3: micro(3, wg, kc, xv, xs, kn, c, Mp, k0 == 0); break;
                        case 2: micro(2, wg, kc, xv, xs, kn, c, Mp, k0 == 0); break;
                        default: micro(1, wg, kc, xv, xs, kn, c, Mp, k0 == 0); break;
                        }
                    }
                }
            }
            for (int m = 0; m < M; m++)
                for (int r = 0; r < rows; r++) y[(size_t)m * N + 32 * np + r] = cb[(size_t)r * Mp + m];
        }
        free(wb);
        free(cb);
    }
    return !failed;
#else
    (void)fmt, (void)w, (void)scale, (void)B, (void)N, (void)K, (void)x, (void)M, (void)xp, (void)y;
    return 0;
#endif
}

/* the token-vector width xp is padded to (0 where the fused product is not built) */
int f32_packed_lanes(void) {
#ifdef PK_LANES
    return PK_LANES;
#else
    return 0;
#endif
}
