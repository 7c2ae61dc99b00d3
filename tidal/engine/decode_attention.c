// Decode attention over the paged KV cache, read in place: one query token per sequence; the
// query, the cache and the output all float32 or all bfloat16, the sums in float32.
// Built and loaded by tidal/engine/native.py (no torch headers: a plain C ABI called by ctypes).
//
// For sequence b and KV head h, the G = H / Hkv query heads that share it (query head h*G + g)
// attend over the cache rows slots[b, j], j in [start_b, len_b), start_b = max(0, len_b - window)
// with a sliding window (else 0):
//   s_gj = cap(q_g . k_j * scale),  cap(x) = c * tanh(x / c) with soft-capping c > 0, else x
//   out_g = sum_j softmax_j(s_g)_j * v_j
// The G heads of one (b, h) run back to back (float32) or up to four together (bf16: a row is
// then read and widened once for them). Work items are the (b, h) pairs, split into contiguous ranges over `threads` OpenMP
// threads: built with -fopenmp the library links libgomp.so.1, the one torch loaded, so it runs on
// torch's own thread pool (threads of a second pool would spin against torch's for the cores).
// Built without OpenMP it runs on the calling thread. D and Dv are multiples of 8. bfloat16 rows
// are widened to float32 as they are read (exact: bf16 is fp32's upper half) and the output is
// rounded to bf16 once, to nearest even, as torch rounds.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_vec.h"

typedef struct {
    const void *q;  // [B, H, D] with strides q_b, q_h (elements), unit stride in D
    const void *k;  // key cache rows: slot s, head h at element s * k_s + h * k_h
    const void *v;  // value cache rows, likewise with v_s, v_h; Dv elements each
    const int64_t *slots;  // [B, C] cache slot of each context position (row-major)
    const int64_t *lens;   // [B] context length (the query's position + 1)
    void *out;             // [B, H, Dv] contiguous
    int64_t H, Hkv, D, Dv, C, q_b, q_h, k_s, k_h, v_s, v_h, window;
    float scale, softcap;
    int64_t first, last;  // work items [first, last)
    int bf16;             // q, the cache and out hold bfloat16 (else float32)
    int failed;
} Task;

// The rows the pass after this one reads first: n rows of `width` elements from element offset
// off + rows[j] * stride of base. A pass asks for its rows PREFETCH ahead and, as it ends, for
// the next pass's first ones (the values after the keys, the next work item's keys after the
// values), so no pass starts by waiting on memory: 1.15-1.2x faster on 30 cold bf16 layers.
typedef struct {
    const void *base;
    int64_t off;
    const int64_t *rows;
    int64_t stride, n, width;
} Next;

#define PREFETCH 8

// Prefetch row idx of this pass (n rows of `width` from off + rows[j] * stride of base) or,
// past its end, row idx - n of the next pass.
ALWAYS_INLINE void prefetch_at(const void *base, int64_t off, const int64_t *rows, int64_t stride, int64_t n,
                               int64_t width, const Next *nx, int64_t idx, int bf16) {
    if (idx < n)
        prefetch_row(base, off + rows[idx] * stride, width, bf16);
    else if (idx - n < nx->n)
        prefetch_row(nx->base, nx->off + nx->rows[idx - n] * nx->stride, nx->width, bf16);
}

// The context of work item `item` (sequence b = item / Hkv, KV head item % Hkv): its first cache
// row's position in `slots` and its row count, within the sliding window.
static inline const int64_t *context(const Task *t, int64_t item, int64_t *n) {
    const int64_t b = item / t->Hkv, len = t->lens[b];
    const int64_t start = (t->window > 0 && len > t->window) ? len - t->window : 0;
    *n = len - start;
    return t->slots + b * t->C + start;
}

// The first key rows of work item `item` (none past the thread's last).
static inline Next first_keys(const Task *t, int64_t item) {
    Next keys = {t->k, 0, t->slots, 0, 0, t->D};
    if (item < t->last) {
        int64_t n;
        keys.rows = context(t, item, &n);
        keys.off = item % t->Hkv * t->k_h, keys.stride = t->k_s, keys.n = n < PREFETCH ? n : PREFETCH;
    }
    return keys;
}

// s <- softmax(s) over n scores
static inline void softmax(float *s, int64_t n) {
    float m = s[0];
    for (int64_t j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
    const float sum = exp_sum(s, 0, n, m, 1.0f, s, 0);
    const float inv = 1.0f / sum;
    for (int64_t j = 0; j < n; j++) s[j] *= inv;
}

// s[g * n + j] = q_g . (the d elements of k from k0 + rows[j] * row_stride), for the n rows and
// the G <= 4 query heads q_g = q + g * q_h (G is a constant at each call: the compiler unrolls the
// heads). Each key row is read, and widened, once for the G heads; R rows at a time (four for one
// head, two for more: the sums then fill the registers).
ALWAYS_INLINE void scores_of(float *s, const float *q, int64_t q_h, const void *k, int64_t k0, const int64_t *rows,
                             int64_t row_stride, int64_t n, int64_t d, const Next *nx, int bf16, const int G) {
    const int R = G == 1 ? 4 : 2;
    int64_t j = 0;
    for (; j + R <= n; j += R) {
        for (int i = PREFETCH; i < PREFETCH + R; i++) prefetch_at(k, k0, rows, row_stride, n, d, nx, j + i, bf16);
        int64_t r[4];
        for (int i = 0; i < R; i++) r[i] = k0 + rows[j + i] * row_stride;
        v8 a[4][4] = {{{0}}};
        for (int64_t c = 0; c < d; c += 8) {
            v8 x[4];
            for (int i = 0; i < R; i++) x[i] = load8(k, r[i] + c, bf16);
            for (int g = 0; g < G; g++) {
                const v8 qc = *(const v8 *)(q + g * q_h + c);
                for (int i = 0; i < R; i++) a[g][i] += qc * x[i];
            }
        }
        for (int g = 0; g < G; g++)
            for (int i = 0; i < R; i++) s[g * n + j + i] = hsum(a[g][i]);
    }
    for (; j < n; j++) {
        const int64_t r = k0 + rows[j] * row_stride;
        v8 a[4] = {{0}};
        for (int64_t c = 0; c < d; c += 8) {
            const v8 x = load8(k, r + c, bf16);
            for (int g = 0; g < G; g++) a[g] += *(const v8 *)(q + g * q_h + c) * x;
        }
        for (int g = 0; g < G; g++) s[g * n + j] = hsum(a[g]);
    }
}

// o_g = sum_j p_g[j] * (the dv elements of v from v0 + rows[j] * row_stride), for the G <= 4 heads
// (p_g = p + g * n, o_g = o + g * dv; G a constant at each call). Each value row is read, and
// widened, once for all G heads; 32 columns at a time, then 8.
ALWAYS_INLINE void weighted_sum(float *o, const float *p, int64_t n, const void *v, int64_t v0, const int64_t *rows,
                                int64_t row_stride, int64_t dv, const Next *nx, int bf16, const int G) {
    int64_t c = 0;
    for (; c + 32 <= dv; c += 32) {
        v8 a[4][4] = {{{0}}};
        for (int64_t j = 0; j < n; j++) {
            if (c == 0) prefetch_at(v, v0, rows, row_stride, n, dv, nx, j + PREFETCH, bf16);
            const int64_t r = v0 + rows[j] * row_stride + c;
            const v8 x0 = load8(v, r, bf16), x1 = load8(v, r + 8, bf16), x2 = load8(v, r + 16, bf16), x3 = load8(v, r + 24, bf16);
            for (int g = 0; g < G; g++) {
                const float w = p[g * n + j];
                a[g][0] += w * x0, a[g][1] += w * x1, a[g][2] += w * x2, a[g][3] += w * x3;
            }
        }
        for (int g = 0; g < G; g++)
            for (int i = 0; i < 4; i++) *(v8 *)(o + g * dv + c + 8 * i) = a[g][i];
    }
    for (; c < dv; c += 8) {
        v8 a[4] = {{0}};
        for (int64_t j = 0; j < n; j++) {
            const v8 x = load8(v, v0 + rows[j] * row_stride + c, bf16);
            for (int g = 0; g < G; g++) a[g] += p[g * n + j] * x;
        }
        for (int g = 0; g < G; g++) *(v8 *)(o + g * dv + c) = a[g];
    }
}

// Heads g0 .. g0 + G - 1 of one (sequence, KV head): scores, softmax, weighted sum (G <= 4).
ALWAYS_INLINE void heads(const Task *t, float *scores, const float *q, int64_t q_h, float *o, int64_t h,
                         const int64_t *slot, int64_t n, const Next *after, int bf16, const int G) {
    const Next values = {t->v, h * t->v_h, slot, t->v_s, n, t->Dv};
    scores_of(scores, q, q_h, t->k, h * t->k_h, slot, t->k_s, n, t->D, &values, bf16, G);
    for (int g = 0; g < G; g++) {
        float *sg = scores + g * n;
        if (t->softcap > 0) {
            for (int64_t j = 0; j < n; j++) sg[j] = t->softcap * tanhf(sg[j] * t->scale / t->softcap);
        } else {
            for (int64_t j = 0; j < n; j++) sg[j] *= t->scale;
        }
        softmax(sg, n);
    }
    weighted_sum(o, scores, n, t->v, h * t->v_h, slot, t->v_s, t->Dv, after, bf16, G);
}

static inline void run(Task *t, const int bf16) {
    const int64_t G = t->H / t->Hkv;
    // scratch: the G heads' scores, and for bf16 their queries and outputs in float32
    float *scores = malloc(sizeof(float) * (size_t)(G * ((t->C > 0 ? t->C : 1) + t->D + t->Dv)));
    if (!scores) {
        t->failed = 1;
        return;
    }
    float *qbuf = scores + G * (t->C > 0 ? t->C : 1), *obuf = qbuf + G * t->D;
    for (int64_t item = t->first; item < t->last; item++) {
        const int64_t b = item / t->Hkv, h = item % t->Hkv;
        int64_t n;
        const int64_t *slot = context(t, item, &n);
        const int64_t q0 = b * t->q_b + h * G * t->q_h, o0 = (b * t->H + h * G) * t->Dv;
        const float *q = (const float *)t->q + q0;
        int64_t q_h = t->q_h;
        float *o = bf16 ? obuf : (float *)t->out + o0;
        if (bf16) {  // the G query rows widened once
            for (int64_t g = 0; g < G; g++)
                for (int64_t c = 0; c < t->D; c += 8) *(v8 *)(qbuf + g * t->D + c) = load8(t->q, q0 + g * t->q_h + c, 1);
            q = qbuf, q_h = t->D;
        }
        if (n <= 0) {  // no key to attend: zeros (the caller never asks for this)
            for (int64_t g = 0; g < G * t->Dv; g++) o[g] = 0;
        }
        // bf16: up to four heads per pass over the rows (1.13x the speed on a Zen 4); float32: a head
        // at a time, as four per pass ran at 0.89-0.94x the speed there (AVX2 and AVX-512)
        const int64_t per_pass = bf16 ? 4 : 1;
        // after a pass of heads: the same keys for the next heads, else the next item's
        const Next same = first_keys(t, item), next = first_keys(t, item + 1);
        for (int64_t g = 0; g < G && n > 0; g += per_pass) {
            const float *qg = q + g * q_h;
            float *og = o + g * t->Dv;
            const Next *after = g + per_pass < G ? &same : &next;
            switch (G - g < per_pass ? G - g : per_pass) {
                case 1: heads(t, scores, qg, q_h, og, h, slot, n, after, bf16, 1); break;
                case 2: heads(t, scores, qg, q_h, og, h, slot, n, after, bf16, 2); break;
                case 3: heads(t, scores, qg, q_h, og, h, slot, n, after, bf16, 3); break;
                default: heads(t, scores, qg, q_h, og, h, slot, n, after, bf16, 4); break;
            }
        }
        if (bf16)
            for (int64_t i = 0; i < G * t->Dv; i++) ((uint16_t *)t->out)[o0 + i] = to_bf16(o[i]);
    }
    free(scores);
}

// One instance per element type, so it is a constant in the inner loops.
static void run_f32(Task *t) { run(t, 0); }
static void run_bf16(Task *t) { run(t, 1); }

// Returns 0 on success, 1 when scratch memory could not be had (the output is then not trusted).
// `bf16`: q, the key and value caches and out hold bfloat16 (else float32).
int tidal_decode_attention(const void *q, const void *k, const void *v, const int64_t *slots,
                           const int64_t *lens, void *out, int64_t B, int64_t H, int64_t Hkv,
                           int64_t D, int64_t Dv, int64_t C, int64_t q_b, int64_t q_h, int64_t k_s,
                           int64_t k_h, int64_t v_s, int64_t v_h, int64_t window, float scale,
                           float softcap, int64_t threads, int64_t bf16) {
    const int64_t items = B * Hkv;
    if (threads > items) threads = items;
    if (threads < 1) threads = 1;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed)
    for (int64_t i = 0; i < threads; i++) {
        Task t = {q, k, v, slots, lens, out, H, Hkv, D, Dv, C, q_b, q_h, k_s, k_h, v_s, v_h,
                  window, scale, softcap, items * i / threads, items * (i + 1) / threads, bf16 != 0, 0};
        if (t.bf16)
            run_bf16(&t);
        else
            run_f32(&t);
        failed |= t.failed;
    }
    return failed;
}
