// Sampling one token per row from softmax(z / t) over a row of logits z (float32 or bfloat16),
// read in place: no [B, V] probabilities are written. Built with decode_attention.c into the
// library tidal/engine/native.py loads.
//
// The draw is tidal.engine.sampling's inverse CDF over the unnormalised weights
// e_v = exp((z_v - max z) / t): the first token whose cumulative weight exceeds u * S, S = sum e_v,
// found chunk by chunk (the sums of 256-token chunks first, then the token inside its chunk), so
// a token of zero weight is never drawn. Its log-prob is (z_v - max z) / t - log S.
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#include "native_vec.h"

#define CHUNK 256

// Returns 0, or 1 when a row's weights do not sum to a positive finite number (NaN or infinite
// logits): that row's token is then -1.
static int sample_row(const void *z, int64_t V, float t, float u, float *chunks, int bf16, int64_t *token,
                      float *log_prob) {
    v8 mv = (v8){0} - INFINITY;
    i8 nan = {0};
    int64_t v = 0;
    for (; v + 8 <= V; v += 8) {
        const v8 x = load8(z, v, bf16);
        mv = (v8)(((i8)x & (x > mv)) | ((i8)mv & ~(x > mv)));  // lane-wise max
        nan |= x != x;
    }
    float m = mv[0];
    int bad = 0;
    for (int i = 0; i < 8; i++) m = mv[i] > m ? mv[i] : m, bad |= nan[i];
    for (; v < V; v++) m = elem(z, v, bf16) > m ? elem(z, v, bf16) : m, bad |= isnan(elem(z, v, bf16));
    const float inv_t = 1.0f / t;
    const int64_t n_chunks = (V + CHUNK - 1) / CHUNK;
    float total = 0;
    for (int64_t c = 0; c < n_chunks; c++) {
        const int64_t hi = (c + 1) * CHUNK < V ? (c + 1) * CHUNK : V;
        chunks[c] = exp_sum(z, c * CHUNK, hi, m, inv_t, NULL, bf16);
        total += chunks[c];  // the chunks' cumulative sum, in order
        chunks[c] = total;
    }
    if (bad || !(total > 0) || !isfinite(total)) {
        *token = -1;
        return 1;
    }
    float target = u * total;
    if (!(target < total)) target = nextafterf(total, 0.0f);
    int64_t c = 0;
    while (c < n_chunks - 1 && !(chunks[c] > target)) c++;
    const float before = c > 0 ? chunks[c - 1] : 0.0f;
    float w[CHUNK];
    const int64_t lo = c * CHUNK, hi = (c + 1) * CHUNK < V ? (c + 1) * CHUNK : V;
    exp_sum(z, lo, hi, m, inv_t, w, bf16);
    const float rest = target - before > 0 ? target - before : 0.0f;
    float cum = 0;
    int64_t pick = -1, last_nonzero = lo;
    for (int64_t i = 0; i < hi - lo; i++) {
        if (w[i] > 0) last_nonzero = lo + i;
        cum += w[i];
        if (cum > rest) {
            pick = lo + i;
            break;
        }
    }
    if (pick < 0 || w[pick - lo] <= 0) pick = last_nonzero;  // rounding ran past the chunk's end
    *token = pick;
    *log_prob = (elem(z, pick, bf16) - m) * inv_t - logf(total);
    return 0;
}

// For each of the B rows of `logits` (row b at element b * ld; V tokens; float32, or bfloat16
// with bf16 != 0): a token drawn with uniform u[b] from softmax(z / temperature[b]) (temperature
// > 0) and its log-prob. Rows are split over `threads` OpenMP threads, as in decode_attention.c.
// Returns the number of rows that failed (see sample_row), or -1 when scratch memory could not be
// had.
int tidal_sample(const void *logits, int64_t B, int64_t V, int64_t ld, int64_t bf16, const float *temperature,
                 const float *u, int64_t *tokens, float *log_probs, int64_t threads) {
    if (threads > B) threads = B;
    if (threads < 1) threads = 1;
    int failed = 0, no_memory = 0;
#pragma omp parallel for num_threads(threads) schedule(static) reduction(+ : failed) reduction(| : no_memory)
    for (int64_t i = 0; i < threads; i++) {
        float *chunks = malloc(sizeof(float) * (size_t)((V + CHUNK - 1) / CHUNK));
        if (!chunks) {
            no_memory = 1;
            continue;
        }
        for (int64_t b = B * i / threads; b < B * (i + 1) / threads; b++) {
            const char *row = (const char *)logits + b * ld * (bf16 ? 2 : 4);
            failed += bf16 ? sample_row(row, V, temperature[b], u[b], chunks, 1, tokens + b, log_probs + b)
                           : sample_row(row, V, temperature[b], u[b], chunks, 0, tokens + b, log_probs + b);
        }
        free(chunks);
    }
    return no_memory ? -1 : failed;
}
