// Decode attention over the paged KV cache, read in place: one query token per sequence, float32.
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
// Built without OpenMP it runs on the calling thread. D and Dv are multiples of 8.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    const float *q;  // [B, H, D] with strides q_b, q_h (elements), unit stride in D
    const float *k;  // key cache rows: slot s, head h at k + s * k_s + h * k_h
    const float *v;  // value cache rows, likewise with v_s, v_h; Dv elements each
    const int64_t *slots;  // [B, C] cache slot of each context position (row-major)
    const int64_t *lens;   // [B] context length (the query's position + 1)
    float *out;            // [B, H, Dv] contiguous
    int64_t H, Hkv, D, Dv, C, q_b, q_h, k_s, k_h, v_s, v_h, window;
    float scale, softcap;
    int64_t first, last;  // work items [first, last)
    int failed;
} Task;

// Eight floats as one vector (an AVX2 register; two SSE registers, or NEON pairs, elsewhere). The
// loops below keep four independent sums in flight: one sum's chain of FMAs would wait on each
// FMA's latency, several fill the pipeline. Rows are read unaligned.
typedef float v8 __attribute__((vector_size(32), aligned(4)));

static inline float hsum(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// s[j] = q . k_{rows[j]} for the n rows; d a multiple of 8
static void scores_of(float *s, const float *q, const float *k, const int64_t *rows, int64_t row_stride,
                      int64_t n, int64_t d) {
    int64_t j = 0;
    for (; j + 4 <= n; j += 4) {
        const float *k0 = k + rows[j] * row_stride, *k1 = k + rows[j + 1] * row_stride;
        const float *k2 = k + rows[j + 2] * row_stride, *k3 = k + rows[j + 3] * row_stride;
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t c = 0; c < d; c += 8) {
            const v8 qc = *(const v8 *)(q + c);
            a0 += qc * *(const v8 *)(k0 + c);
            a1 += qc * *(const v8 *)(k1 + c);
            a2 += qc * *(const v8 *)(k2 + c);
            a3 += qc * *(const v8 *)(k3 + c);
        }
        s[j] = hsum(a0), s[j + 1] = hsum(a1), s[j + 2] = hsum(a2), s[j + 3] = hsum(a3);
    }
    for (; j < n; j++) {
        const float *kr = k + rows[j] * row_stride;
        v8 a = {0};
        for (int64_t c = 0; c < d; c += 8) a += *(const v8 *)(q + c) * *(const v8 *)(kr + c);
        s[j] = hsum(a);
    }
}

// o = sum_j p[j] * v_{rows[j]} over the n rows; dv a multiple of 8
static void weighted_sum(float *o, const float *p, const float *v, const int64_t *rows, int64_t row_stride,
                         int64_t n, int64_t dv) {
    int64_t c = 0;
    for (; c + 32 <= dv; c += 32) {
        v8 a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
        for (int64_t j = 0; j < n; j++) {
            const float *vr = v + rows[j] * row_stride + c;
            const float w = p[j];
            a0 += w * *(const v8 *)vr;
            a1 += w * *(const v8 *)(vr + 8);
            a2 += w * *(const v8 *)(vr + 16);
            a3 += w * *(const v8 *)(vr + 24);
        }
        *(v8 *)(o + c) = a0, *(v8 *)(o + c + 8) = a1, *(v8 *)(o + c + 16) = a2, *(v8 *)(o + c + 24) = a3;
    }
    for (; c < dv; c += 8) {
        v8 a = {0};
        for (int64_t j = 0; j < n; j++) a += p[j] * *(const v8 *)(v + rows[j] * row_stride + c);
        *(v8 *)(o + c) = a;
    }
}

static void run(Task *t) {
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
            scores_of(sg, q + g * t->q_h, t->k + h * t->k_h, slot, t->k_s, n, t->D);
            for (int64_t j = 0; j < n; j++) {
                float s = sg[j] * t->scale;
                sg[j] = t->softcap > 0 ? t->softcap * tanhf(s / t->softcap) : s;
            }
            float m = sg[0];
            for (int64_t j = 1; j < n; j++) m = sg[j] > m ? sg[j] : m;
            float sum = 0;
            for (int64_t j = 0; j < n; j++) {
                sg[j] = expf(sg[j] - m);
                sum += sg[j];
            }
            const float inv = 1.0f / sum;
            for (int64_t j = 0; j < n; j++) sg[j] *= inv;
            weighted_sum(o + g * t->Dv, sg, t->v + h * t->v_h, slot, t->v_s, n, t->Dv);
        }
    }
    free(scores);
}

// Returns 0 on success, 1 when scratch memory could not be had (the output is then not trusted).
int tidal_decode_attention(const float *q, const float *k, const float *v, const int64_t *slots,
                           const int64_t *lens, float *out, int64_t B, int64_t H, int64_t Hkv,
                           int64_t D, int64_t Dv, int64_t C, int64_t q_b, int64_t q_h, int64_t k_s,
                           int64_t k_h, int64_t v_s, int64_t v_h, int64_t window, float scale,
                           float softcap, int64_t threads) {
    const int64_t items = B * Hkv;
    if (threads > items) threads = items;
    if (threads < 1) threads = 1;
    int failed = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(| : failed)
    for (int64_t i = 0; i < threads; i++) {
        Task t = {q, k, v, slots, lens, out, H, Hkv, D, Dv, C, q_b, q_h, k_s, k_h, v_s, v_h,
                  window, scale, softcap, items * i / threads, items * (i + 1) / threads, 0};
        run(&t);
        failed |= t.failed;
    }
    return failed;
}
