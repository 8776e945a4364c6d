/* mHC's Sinkhorn normalisation of the hc x hc comb matrices, fused: the torch version is ~120 tiny ops per call
   (two calls a block), which is most of a small model's decode step. Same operations in the same order as
   model/mhc.py's sinkhorn: a softmax over each row (+eps after the division), a column normalisation, then
   (iters - 1) rounds of rows and columns, each dividing by (sum + eps). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>


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

/* mHC's mixing weights for T tokens, fused (model/mhc.py's mixes, about a dozen ops a call, two calls a block):
   per token, the RMS statistic of its hc*d values, the projections onto the (2+hc)*hc rows of fn scaled by it,
   then pre = sigmoid(m scale0 + base) + hc_eps, post = 2 sigmoid(m scale1 + base), comb = Sinkhorn(m scale2 + base).
   out per token: pre [hc], post [hc], comb [hc][hc] (the rows of m in their order). Sums run in another order than
   torch's: equal to fp32 rounding, not bit for bit. */
static float dot(const float *a, const float *b, int64_t n) {
    float acc[16] = {0};
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        for (int j = 0; j < 16; j++) acc[j] += a[i + j] * b[i + j];
    float s = 0.0f;
    for (; i < n; i++) s += a[i] * b[i];
    for (int j = 0; j < 16; j++) s += acc[j];
    return s;
}

void mhc_mixes(const float *x, int64_t T, int hc, int d, const float *fn, const float *scale, const float *base,
               int iters, float eps, float hc_eps, float *out) {
    const int64_t n = (int64_t)hc * d;
    const int rows_m = (2 + hc) * hc;
    float *rs = malloc((size_t)T * sizeof(float));
    /* the projections dot by dot over the threads, not token by token: one decode token's (2+hc)hc rows of fn are
     * 2 MB at V4.1's widths, which one thread streams at half the rate two do */
#pragma omp parallel if (T * n * rows_m > (1 << 18))
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) rs[t] = 1.0f / sqrtf(dot(x + t * n, x + t * n, n) / (float)n + eps);
#pragma omp for schedule(static)
        for (int64_t k = 0; k < T * rows_m; k++) {
            const int64_t t = k / rows_m, j = k % rows_m;
            out[k] = dot(x + t * n, fn + j * n, n) * rs[t];
        }
#pragma omp for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *o = out + t * rows_m;
            for (int i = 0; i < hc; i++) {
                o[i] = 1.0f / (1.0f + expf(-(o[i] * scale[0] + base[i]))) + hc_eps;
                o[hc + i] = 2.0f / (1.0f + expf(-(o[hc + i] * scale[1] + base[hc + i])));
            }
            for (int j = 2 * hc; j < rows_m; j++) o[j] = o[j] * scale[2] + base[j];
            sinkhorn(o + 2 * hc, 1, hc, iters, hc_eps);
        }
    }
    free(rs);
}

/* out = g * (x / sqrt(mean(x^2) + eps)), as RMSNorm rounds it but for the order of the mean's sum; out may be x */
static void norm_row(const float *x, float *out, int d, const float *g, float eps) {
    const float r = 1.0f / sqrtf(dot(x, x, d) / (float)d + eps);
    for (int i = 0; i < d; i++) out[i] = g[i] * (x[i] * r);
}

/* A block's collapse of the hc streams and the RMSNorm after it, fused (model/mhc.py's collapse, then RMSNorm):
   per token, y = sum_j w[j] x[j] over the streams in their order, then g * y / sqrt(mean(y^2) + eps). Torch's chain
   is a dozen small ops, each paying for a dispatch whose caches the weight streams between them have evicted. The
   collapse rounds as torch's does; the norm's mean sums in another order (equal to fp32 rounding). */
void hc_collapse_norm(const float *x, int64_t T, int hc, int d, const float *w, const float *g, float eps,
                      float *out) {
#pragma omp parallel for schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const float *xt = x + t * hc * d, *wt = w + t * hc;
        float *o = out + t * d;
        for (int i = 0; i < d; i++) o[i] = wt[0] * xt[i];
        for (int j = 1; j < hc; j++)
            for (int i = 0; i < d; i++) o[i] += wt[j] * xt[(int64_t)j * d + i];
        norm_row(o, o, d, g, eps);
    }
}

/* RMSNorm of T rows of d (model/layers.py's RMSNorm, fp32): the norms of a decode step's attention (q, kv, the
   compressor's and indexer's), one call each instead of six small ops. */
void rms_norm(const float *x, int64_t T, int d, const float *g, float eps, float *out) {
#pragma omp parallel for schedule(static) if (T * d > (1 << 16))
    for (int64_t t = 0; t < T; t++) norm_row(x + t * d, out + t * d, d, g, eps);
}

/* A block's expansion back into the streams (model/mhc.py's expand): X'_k = post_k f + sum_j comb[j][k] X_j, the
   sum over j in order, as torch rounds it. f [T, d], x [T, hc, d], post [T, hc], comb [T, hc, hc] -> out [T, hc, d]. */
void hc_expand(const float *f, const float *x, const float *post, const float *comb, int64_t T, int hc, int d,
               float *out) {
#pragma omp parallel for schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const float *ft = f + t * d, *xt = x + t * hc * d, *ct = comb + t * hc * hc;
        for (int k = 0; k < hc; k++) {
            float *o = out + (t * hc + k) * d;
            const float pk = post[t * hc + k];
            for (int i = 0; i < d; i++) o[i] = ct[k] * xt[i];
            for (int j = 1; j < hc; j++)
                for (int i = 0; i < d; i++) o[i] += ct[j * hc + k] * xt[(int64_t)j * d + i];
            for (int i = 0; i < d; i++) o[i] = pk * ft[i] + o[i];
        }
    }
}

/* The MoE router for T tokens (model/moe.py's Gate): z = W x / temp over E experts, scores by `func` (0 softmax,
   1 sigmoid, 2 sqrt(softplus), softplus linear above 20 as torch's), the k best of scores + bias picked (the bias
   only selects), in descending order (ties: the lower id first), weights = their scores, normalised to sum 1
   (+1e-20) where norm, times scale. About a dozen small torch operations a layer otherwise. ids: int64 [T, k]. */
void moe_route(const float *x, int64_t T, int d, const float *W, const float *bias, int E, float temp, int func, int k,
               int norm, float scale, float *wts, int64_t *ids) {
#pragma omp parallel for schedule(static) if (T * E * d > (1 << 20))
    for (int64_t t = 0; t < T; t++) {
        float s[E], sel[E];
        const float *xt = x + t * d;
        for (int e = 0; e < E; e++) s[e] = dot(xt, W + (int64_t)e * d, d) / temp;
        if (func == 0) {
            float mx = s[0], sum = 0.0f;
            for (int e = 1; e < E; e++) mx = fmaxf(mx, s[e]);
            for (int e = 0; e < E; e++) sum += (s[e] = expf(s[e] - mx));
            for (int e = 0; e < E; e++) s[e] /= sum;
        } else {
            for (int e = 0; e < E; e++)
                s[e] = func == 1 ? 1.0f / (1.0f + expf(-s[e])) : sqrtf(s[e] > 20.0f ? s[e] : log1pf(expf(s[e])));
        }
        for (int e = 0; e < E; e++) sel[e] = s[e] + bias[e];
        float *w = wts + t * k, total = 0.0f;
        int64_t *id = ids + t * k;
        unsigned char taken[E];
        memset(taken, 0, sizeof taken);
        for (int j = 0; j < k; j++) { /* k is small (6-8): selection by repeated maximum */
            int best = -1;
            for (int e = 0; e < E; e++)
                if (!taken[e] && (best < 0 || sel[e] > sel[best])) best = e;
            taken[best] = 1;
            id[j] = best;
            w[j] = s[best];
            total += s[best];
        }
        for (int j = 0; j < k; j++) w[j] = (norm && k > 1 ? w[j] / (total + 1e-20f) : w[j]) * scale;
    }
}

/* Rotary embedding (model/layers.py's Rope.rotate) of rows of `width` values: the first width - dim copied, the
   last dim rotated pair by pair, (a, b) -> (a c - b s, a s + b c) with row r's (c, s) pairs from cis row
   (r / per) % S (conjugated when inverse). Torch's version is a view, a complex product and a concatenation, about
   eight operations for each of a decode step's ~17 rotations. */
void rope_rotate(const float *x, int64_t rows, int width, int dim, const float *cis, int64_t per, int64_t S,
                 int inverse, float *out) {
    const int head = width - dim;
#pragma omp parallel for schedule(static) if (rows * width > (1 << 18))
    for (int64_t r = 0; r < rows; r++) {
        const float *xr = x + r * width, *c = cis + ((r / per) % S) * dim;
        float *o = out + r * width;
        memcpy(o, xr, (size_t)head * sizeof(float));
        for (int j = 0; j < dim; j += 2) {
            const float a = xr[head + j], b = xr[head + j + 1], cr = c[j], ci = inverse ? -c[j + 1] : c[j + 1];
            o[head + j] = a * cr - b * ci;
            o[head + j + 1] = a * ci + b * cr;
        }
    }
}

/* Engram's gated write into the streams (model/engram.py after its wkv product), T tokens: kv [T, (hc + 1) d] holds
   hc keys then the value; per stream j, g = sigmoid(signed sqrt of (sum_i x_j[i] (qw_j[i] kw_j[i]) k_j[i]) / (rms(x_j)
   rms(k_j)) * scale) and out_j = x_j + g v. About fifteen small torch operations a call otherwise. */
void engram_gate(const float *x, const float *kv, int64_t T, int hc, int d, const float *qw, const float *kw,
                 float eps, float scale, float *out) {
#pragma omp parallel for schedule(static) if (T > 4)
    for (int64_t t = 0; t < T; t++) {
        const float *v = kv + (t * (hc + 1) + hc) * d;
        for (int j = 0; j < hc; j++) {
            const float *h = x + (t * hc + j) * d, *k = kv + (t * (hc + 1) + j) * d;
            const float *q = qw + (int64_t)j * d, *kk = kw + (int64_t)j * d;
            float s = 0.0f;
            for (int i = 0; i < d; i++) s += h[i] * (q[i] * kk[i]) * k[i];
            const float rstd = (1.0f / sqrtf(dot(h, h, d) / (float)d + eps)) * (1.0f / sqrtf(dot(k, k, d) / (float)d + eps));
            const float z = s * rstd * scale, a = sqrtf(fmaxf(fabsf(z), 1e-6f));
            const float g = 1.0f / (1.0f + expf(-copysignf(a, z)));
            float *o = out + (t * hc + j) * d;
            for (int i = 0; i < d; i++) o[i] = h[i] + g * v[i];
        }
    }
}
