/* Sparse attention and the indexer's scores for a few queries (decode steps, a speculative verify), each query
 * computed on its own in one fixed order: its selected rows in selection order, dot products and sums in a fixed
 * lane structure. torch's batched products choose their kernels by the number of query rows, so a query's bits
 * there depend on how many queries run beside it; a speculative verify's positions then differ from the plain
 * decode steps at the same positions by float noise, which the model's fake-quant points and top-k selections
 * can turn into a different token. Here a query's result depends only on its own inputs.
 *
 * Built with the other kernels (native.py); vector loops for AVX-512 and AVX2 (simd.h), portable C elsewhere.
 * Each build is self-consistent; builds differ from each other and from torch by float rounding. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef __AVX512F__
#include <immintrin.h>
#endif
#include "simd.h"

/* below this many multiply-adds a call runs on one thread */
#define PARALLEL_WORK (1 << 16)

/* sum_i a[i] b[i] over n, in 16 lanes (AVX-512), 8 (AVX2) or 8 partial sums (portable), then a fixed reduction */
static inline float dot(const float *a, const float *b, int n) {
    int i = 0;
#ifdef __AVX512F__
    __m512 acc = _mm512_setzero_ps();
    for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
    float s = _mm512_reduce_add_ps(acc);
#elif defined(DSF_AVX2)
    __m256 acc = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    float s = hsum8(acc);
#else
    float p[8] = {0};
    for (; i + 8 <= n; i += 8)
        for (int j = 0; j < 8; j++) p[j] += a[i + j] * b[i + j];
    float s = ((p[0] + p[1]) + (p[2] + p[3])) + ((p[4] + p[5]) + (p[6] + p[7]));
#endif
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* out[j] = s[j] + dot's scalar tail of a[j] . b over [i, n): dot4's end, as dot ends */
static inline void tail4(const float s[4], const float *a0, const float *a1, const float *a2, const float *a3,
                         const float *b, int i, int n, float *out) {
    const float *a[4] = {a0, a1, a2, a3};
    for (int j = 0; j < 4; j++) {
        float v = s[j];
        for (int k = i; k < n; k++) v += a[j][k] * b[k];
        out[j] = v;
    }
}

/* dot(a[j], b, n) for four vectors a[j] at once: four independent chains over the same b, each vector's operations
 * exactly dot's (the same bits) */
static inline void dot4(const float *a0, const float *a1, const float *a2, const float *a3, const float *b, int n,
                        float *out) {
#ifdef __AVX512F__
    __m512 c0 = _mm512_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 bv = _mm512_loadu_ps(b + i);
        c0 = _mm512_fmadd_ps(_mm512_loadu_ps(a0 + i), bv, c0);
        c1 = _mm512_fmadd_ps(_mm512_loadu_ps(a1 + i), bv, c1);
        c2 = _mm512_fmadd_ps(_mm512_loadu_ps(a2 + i), bv, c2);
        c3 = _mm512_fmadd_ps(_mm512_loadu_ps(a3 + i), bv, c3);
    }
    const float s[4] = {_mm512_reduce_add_ps(c0), _mm512_reduce_add_ps(c1), _mm512_reduce_add_ps(c2),
                        _mm512_reduce_add_ps(c3)};
    tail4(s, a0, a1, a2, a3, b, i, n, out);
#elif defined(DSF_AVX2)
    __m256 c0 = _mm256_setzero_ps(), c1 = c0, c2 = c0, c3 = c0;
    int i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 bv = _mm256_loadu_ps(b + i);
        c0 = _mm256_fmadd_ps(_mm256_loadu_ps(a0 + i), bv, c0);
        c1 = _mm256_fmadd_ps(_mm256_loadu_ps(a1 + i), bv, c1);
        c2 = _mm256_fmadd_ps(_mm256_loadu_ps(a2 + i), bv, c2);
        c3 = _mm256_fmadd_ps(_mm256_loadu_ps(a3 + i), bv, c3);
    }
    const float s[4] = {hsum8(c0), hsum8(c1), hsum8(c2), hsum8(c3)};
    tail4(s, a0, a1, a2, a3, b, i, n, out);
#else
    out[0] = dot(a0, b, n), out[1] = dot(a1, b, n), out[2] = dot(a2, b, n), out[3] = dot(a3, b, n);
#endif
}

/* acc[i] += w * x[i] over n */
static inline void axpy(float *acc, float w, const float *x, int n) {
    int i = 0;
#ifdef __AVX512F__
    const __m512 wv = _mm512_set1_ps(w);
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(acc + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(acc + i)));
#elif defined(DSF_AVX2)
    const __m256 wv = _mm256_set1_ps(w);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(acc + i)));
#endif
    for (; i < n; i++) acc[i] = fmaf(w, x[i], acc[i]);
}

/* heads a work item takes: each selected row is read once for these heads (a row is D floats; the heads' queries
 * and outputs stay in cache), and the items still spread over threads when one query runs */
#define HEAD_CHUNK 8

/* out[s, h] = sum over the selected rows r = idx[s, t] >= 0 (in t order) of softmax weights p_t kv[r], divided by
 * (sum_t p_t + exp(sink[h] - top)), with logits l_t = (q[s, h] . kv[r]) * scale, top = max_t l_t (at least
 * -1e30), p_t = exp(l_t - top): model.attention.sparse_attention's definition (K = V, the sink in the
 * denominator only). q [S, H, D], kv [N, D] (one sequence), idx [S, K] (-1: none), out [S, H, D]; work: S H K
 * floats. Each (s, h) runs the same operations in the same order whatever the chunking. */
void sparse_attn(const float *q, int S, int H, int D, const float *kv, const int64_t *idx, int K, const float *sink,
                 float scale, float *out, float *work) {
    const int chunks = (H + HEAD_CHUNK - 1) / HEAD_CHUNK;
    const int64_t items = (int64_t)S * chunks;
#pragma omp parallel for schedule(static) if ((int64_t)S * H * K * D > PARALLEL_WORK && items > 1)
    for (int64_t it = 0; it < items; it++) {
        const int s = (int)(it / chunks), h0 = (int)(it % chunks) * HEAD_CHUNK;
        const int h1 = h0 + HEAD_CHUNK < H ? h0 + HEAD_CHUNK : H;
        const int64_t *sel = idx + (int64_t)s * K;
        float top[HEAD_CHUNK], denom[HEAD_CHUNK];
        for (int h = h0; h < h1; h++) top[h - h0] = -INFINITY, denom[h - h0] = 0.0f;
        for (int t = 0; t < K; t++) {
            if (sel[t] < 0) continue;
            const float *row = kv + sel[t] * D;
            float l[HEAD_CHUNK];
            const float *qs = q + ((int64_t)s * H) * D;
            int h = h0;
            for (; h + 4 <= h1; h += 4)
                dot4(qs + (int64_t)h * D, qs + (int64_t)(h + 1) * D, qs + (int64_t)(h + 2) * D,
                     qs + (int64_t)(h + 3) * D, row, D, l + h - h0);
            for (; h < h1; h++) l[h - h0] = dot(qs + (int64_t)h * D, row, D);
            for (h = h0; h < h1; h++) {
                const float v = l[h - h0] * scale;
                work[((int64_t)s * H + h) * K + t] = v;
                top[h - h0] = v > top[h - h0] ? v : top[h - h0];
            }
        }
        for (int h = h0; h < h1; h++) {
            top[h - h0] = top[h - h0] > -1e30f ? top[h - h0] : -1e30f;
            memset(out + ((int64_t)s * H + h) * D, 0, sizeof(float) * D);
        }
        for (int t = 0; t < K; t++) {
            if (sel[t] < 0) continue;
            const float *row = kv + sel[t] * D;
            for (int h = h0; h < h1; h++) {
                const int64_t sh = (int64_t)s * H + h;
                const float p = expf(work[sh * K + t] - top[h - h0]);
                denom[h - h0] += p;
                axpy(out + sh * D, p, row, D);
            }
        }
        for (int h = h0; h < h1; h++) {
            float *o = out + ((int64_t)s * H + h) * D;
            const float inv = 1.0f / (denom[h - h0] + expf(sink[h] - top[h - h0]));
            for (int i = 0; i < D; i++) o[i] *= inv;
        }
    }
}

/* The indexer's scores: out[s, t] = sum over heads h (in order) of w[s, h] relu(q[s, h] . keys[t]), for q [S, H,
 * D], keys [T, D], w [S, H]; out [S, T]. */
void index_scores(const float *q, int S, int H, int D, const float *keys, int64_t T, const float *w, float *out) {
    const int64_t items = (int64_t)S * T;
#pragma omp parallel for schedule(static) if (items * H * D > PARALLEL_WORK)
    for (int64_t it = 0; it < items; it++) {
        const int64_t s = it / T, t = it % T;
        const float *k = keys + t * D, *qs = q + s * H * D, *ws = w + s * H;
        float acc = 0.0f;
        for (int h = 0; h < H; h++) {
            const float v = dot(qs + (int64_t)h * D, k, D);
            acc += ws[h] * (v > 0.0f ? v : 0.0f);
        }
        out[it] = acc;
    }
}
