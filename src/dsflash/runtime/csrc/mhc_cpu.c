/* mHC's Sinkhorn normalisation of the hc x hc comb matrices, fused: the torch version is ~120 tiny ops per call
   (two calls a block), which is most of a small model's decode step. Same operations in the same order as
   model/mhc.py's sinkhorn: a softmax over each row (+eps after the division), a column normalisation, then
   (iters - 1) rounds of rows and columns, each dividing by (sum + eps). */

#include <math.h>
#include <stdint.h>

static void rows(float *m, int hc, float eps) {
    for (int i = 0; i < hc; i++) {
        float *r = m + i * hc, s = 0.0f;
        for (int j = 0; j < hc; j++) s += r[j];
        const float d = s + eps;
        for (int j = 0; j < hc; j++) r[j] /= d;
    }
}

static void cols(float *m, int hc, float eps) {
    for (int j = 0; j < hc; j++) {
        float s = 0.0f;
        for (int i = 0; i < hc; i++) s += m[i * hc + j];
        const float d = s + eps;
        for (int i = 0; i < hc; i++) m[i * hc + j] /= d;
    }
}

void sinkhorn(float *c, int64_t n, int hc, int iters, float eps) {
#pragma omp parallel for schedule(static) if (n > 256)
    for (int64_t t = 0; t < n; t++) {
        float *m = c + t * hc * hc;
        for (int i = 0; i < hc; i++) {
            float *r = m + i * hc, mx = r[0], s = 0.0f;
            for (int j = 1; j < hc; j++) mx = fmaxf(mx, r[j]);
            for (int j = 0; j < hc; j++) {
                r[j] = expf(r[j] - mx);
                s += r[j];
            }
            for (int j = 0; j < hc; j++) r[j] = r[j] / s + eps;
        }
        cols(m, hc, eps);
        for (int k = 1; k < iters; k++) {
            rows(m, hc, eps);
            cols(m, hc, eps);
        }
    }
}
