// Decode attention over the paged KV cache, read in place: one query token per sequence; the
// query, the output and the sums in float32, the cache in float32 or bfloat16.
// Built and loaded by tidal/engine/native.py (no torch headers: a plain C ABI called by ctypes).
//
// For sequence b and KV head h, the G = H / Hkv query heads that share it (query head h*G + g)
// attend over the cache rows slots[b, j], j in [start_b, len_b), start_b = max(0, len_b - window)
// with a sliding window (else 0):
//   s_gj = cap(q_g . k_j * scale),  cap(x) = c * tanh(x / c) with soft-capping c > 0, else x
//   out_g = sum_j softmax_j(s_g)_j * v_j
// The G heads of one (b, h) run back to back, so a row comes from memory once and from cache for
// the others. Work items are the (b, h) pairs, split into contiguous ranges over `threads` OpenMP
// threads: built with -fopenmp the library links libgomp.so.1, the one torch loaded, so it runs on
// torch's own thread pool (threads of a second pool would spin against torch's for the cores).
// Built without OpenMP it runs on the calling thread. D and Dv are multiples of 8. A bfloat16
// cache row is widened to float32 as it is read (exact: bf16 is fp32's upper half).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_vec.h"

typedef struct {
    const float *q;  // [B, H, D] with strides q_b, q_h (elements), unit stride in D
    const void *k;  // key cache rows: slot s, head h at element s * k_s + h * k_h
    const void *v;  // value cache rows, likewise with v_s, v_h; Dv elements each
    const int64_t *slots;  // [B, C] cache slot of each context position (row-major)
    const int64_t *lens;   // [B] context length (the query's position + 1)
    float *out;            // [B, H, Dv] contiguous
    int64_t H, Hkv, D, Dv, C, q_b, q_h, k_s, k_h, v_s, v_h, window;
    float scale, softcap;
    int64_t first, last;  // work items [first, last)
    int bf16;             // the cache holds bfloat16 (else float32)
    int failed;
} Task;

// s <- softmax(s) over n scores
static inline void softmax(float *s, int64_t n) {
    float m = s[0];
    for (int64_t j = 1; j < n; j++) m = s[j] > m ? s[j] : m;
    v8 acc = {0};
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        const v8 e = exp8(*(const v8 *)(s + j) - m);
        *(v8 *)(s + j) = e;
        acc += e;
    }
    float sum = hsum(acc);
    for (; j < n; j++) {
        s[j] = expf(s[j] - m);
        sum += s[j];
    }
    const float inv = 1.0f / sum;
    for (j = 0; j < n; j++) s[j] *= inv;
}

// s[j] = q . (the d elements of k from k0 + rows[j] * row_stride) for the n rows; d a multiple of 8
static inline void scores_of(float *s, const float *q, const void *k, int64_t k0, const int64_t *rows,
                             int64_t row_stride, int64_t n, int64_t d, int bf16) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        if (j + 12 <= n)
            for (int i = 8; i < 12; i++) prefetch_row(k, k0 + rows[j + i] * row_stride, d, bf16);
        const int64_t r0 = k0 + rows[j] * row_stride, r1 = k0 + rows[j + 1] * row_stride;
        const int64_t r2 = k0 + rows[j + 2] * row_stride, r3 = k0 + rows[j + 3] * row_stride;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t c = 0; c < d; c += 8) {
            const v8 qc = *(const v8 *)(q + c);
            a0 += qc * load8(k, r0 + c, bf16);
            a1 += qc * load8(k, r1 + c, bf16);
            a2 += qc * load8(k, r2 + c, bf16);
            a3 += qc * load8(k, r3 + c, bf16);
        }
        s[j] = hsum(a0), s[j + 1] = hsum(a1), s[j + 2] = hsum(a2), s[j + 3] = hsum(a3);
    }
    for (; j < n; j++) {
        const int64_t r = k0 + rows[j] * row_stride;
        v8 a = {0};
        for (int64_t c = 0; c < d; c += 8) a += *(const v8 *)(q + c) * load8(k, r + c, bf16);
        s[j] = hsum(a);
    }
}

// o = sum_j p[j] * (the dv elements of v from v0 + rows[j] * row_stride); dv a multiple of 8
static inline void weighted_sum(float *o, const float *p, const void *v, int64_t v0, const int64_t *rows,
                                int64_t row_stride, int64_t n, int64_t dv, int bf16) {
    int64_t c = 0;
    for (; c + 32 <= dv; c += 32) {
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t j = 0; j < n; j++) {
            const int64_t r = v0 + rows[j] * row_stride + c;
            const float w = p[j];
            if (c == 0 && j + 8 < n) prefetch_row(v, v0 + rows[j + 8] * row_stride, dv, bf16);
            a0 += w * load8(v, r, bf16);
            a1 += w * load8(v, r + 8, bf16);
            a2 += w * load8(v, r + 16, bf16);
            a3 += w * load8(v, r + 24, bf16);
        }
        *(v8 *)(o + c) = a0, *(v8 *)(o + c + 8) = a1, *(v8 *)(o + c + 16) = a2, *(v8 *)(o + c + 24) = a3;
    }
    for (; c < dv; c += 8) {
        v8 a = {0};
        for (int64_t j = 0; j < n; j++) a += p[j] * load8(v, v0 + rows[j] * row_stride + c, bf16);
        *(v8 *)(o + c) = a;
    }
}

static inline void run(Task *t, const int bf16) {
    const int64_t G = t->H / t->Hkv;
    float *scores = malloc(sizeof(float) * (size_t)(G * (t->C > 0 ? t->C : 1)));
    if (!scores) {
        t->failed = 1;
        return;
    }
    for (int64_t item = t->first; item < t->last; item++) {
        const int64_t b = item / t->Hkv, h = item % t->Hkv;
        const int64_t len = t->lens[b];
        const int64_t start = (t->window > 0 && len > t->window) ? len - t->window : 0;
        const int64_t n = len - start;
        const int64_t *slot = t->slots + b * t->C + start;
        const float *q = t->q + b * t->q_b + h * G * t->q_h;
        float *o = t->out + (b * t->H + h * G) * t->Dv;
        if (n <= 0) {  // no key to attend: zeros (the caller never asks for this)
            for (int64_t g = 0; g < G * t->Dv; g++) o[g] = 0;
            continue;
        }
        for (int64_t g = 0; g < G; g++) {
            float *sg = scores + g * n;
            scores_of(sg, q + g * t->q_h, t->k, h * t->k_h, slot, t->k_s, n, t->D, bf16);
            if (t->softcap > 0) {
                for (int64_t j = 0; j < n; j++) sg[j] = t->softcap * tanhf(sg[j] * t->scale / t->softcap);
            } else {
                for (int64_t j = 0; j < n; j++) sg[j] *= t->scale;
            }
            softmax(sg, n);
            weighted_sum(o + g * t->Dv, sg, t->v, h * t->v_h, slot, t->v_s, n, t->Dv, bf16);
        }
    }
    free(scores);
}

// One instance per cache type, so the element type is a constant in the inner loops.
static void run_f32(Task *t) { run(t, 0); }
static void run_bf16(Task *t) { run(t, 1); }

// Returns 0 on success, 1 when scratch memory could not be had (the output is then not trusted).
// `kv_bf16`: the key and value caches hold bfloat16 (else float32).
int tidal_decode_attention(const float *q, const void *k, const void *v, const int64_t *slots,
                           const int64_t *lens, float *out, int64_t B, int64_t H, int64_t Hkv,
                           int64_t D, int64_t Dv, int64_t C, int64_t q_b, int64_t q_h, int64_t k_s,
                           int64_t k_h, int64_t v_s, int64_t v_h, int64_t window, float scale,
                           float softcap, int64_t threads, int64_t kv_bf16) {
    const int64_t items = B * Hkv;
    if (threads > items) threads = items;
    if (threads < 1) threads = 1;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed)
    for (int64_t i = 0; i < threads; i++) {
        Task t = {q, k, v, slots, lens, out, H, Hkv, D, Dv, C, q_b, q_h, k_s, k_h, v_s, v_h,
                  window, scale, softcap, items * i / threads, items * (i + 1) / threads, kv_bf16 != 0, 0};
        if (t.bf16)
            run_bf16(&t);
        else
            run_f32(&t);
        failed |= t.failed;
    }
    return failed;
}
