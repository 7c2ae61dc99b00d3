// A decoder layer's row-wise and element-wise pieces as one pass each, for the ones torch runs as
// several small ops (each a dispatch, and in bfloat16 a widening copy): transformers' RMSNorm is
// eight ops (float32 or bfloat16 here), the rotary embedding of q and k fourteen (float32 or
// bfloat16), SwiGLU's activation and product two (float32). Built with the other
// kernels into the library tidal/engine/native.py loads; the rows are split over torch's OpenMP
// threads where a call is big enough to pay for the fork.
//
// bfloat16 rounds where transformers' module rounds (each op's result is stored in the input's
// dtype), so the outputs match its bits but for the order of a row's sum of squares (within one
// bf16 rounding, rarely).
#include <math.h>
#include <stdint.h>

#include "native_vec.h"

// One call's operands: rows of `a` (and `b`, `c`) a_stride (b_stride) elements apart, `cols`
// wide (a multiple of 8); `out` contiguous. Rotary: row r of `a` is head r % heads (a_stride
// apart) of token r / heads (token_stride apart), with rows r / heads of `b` and `c`.
typedef struct {
    const void *a, *b, *c;
    void *out;
    int64_t cols, a_stride, b_stride, heads, token_stride;
    float eps;
} Rows;

typedef void (*RowFn)(const Rows *, int64_t lo, int64_t hi);

#define MIN_PER_THREAD 8192  // elements: below this a call runs on one thread

// fn over rows [0, rows), split into contiguous ranges over up to `threads` OpenMP threads
static void over_rows(RowFn fn, const Rows *op, int64_t rows, int64_t threads) {
    const int64_t most = rows * op->cols / MIN_PER_THREAD;
    threads = most < 1 ? 1 : most < threads ? most : threads;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < threads; i++) fn(op, rows * i / threads, rows * (i + 1) / threads);
}

// x rounded to bfloat16, to nearest even (NaN stays NaN), as to_bf16, in the upper half of each lane
static inline u8 bf16_bits8(v8 x) {
    const u8 u = (u8)x;
    const u8 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
    return (u8)(((i8)rounded & ~(x != x)) | ((i8)((u8){0} + 0x7fc00000u) & (x != x)));
}

// x rounded to bfloat16 and read back as float32 (the value a bf16 tensor would hold)
ALWAYS_INLINE v8 round8(v8 x, int bf16) { return bf16 ? (v8)bf16_bits8(x) : x; }

// Eight floats stored as float32, or rounded to bfloat16
ALWAYS_INLINE void store8(void *base, int64_t at, v8 x, int bf16) {
    if (bf16)
        *(h8 *)((uint16_t *)base + at) = __builtin_convertvector(bf16_bits8(x) >> 16, h8);
    else
        *(v8 *)((float *)base + at) = x;
}

// out[r] = w * round(x[r] * rsqrt(mean(x[r]^2) + eps)) for x = op->a, w = op->b: transformers'
// RMSNorm (the normalised row in float32, rounded to the input's dtype, then the weight's
// product, rounded again).
ALWAYS_INLINE void rms_rows(const Rows *op, int64_t lo, int64_t hi, int bf16) {
    const int64_t cols = op->cols;
    for (int64_t r = lo; r < hi; r++) {
        const int64_t at = r * op->a_stride;
        v8 acc[4] = {{0}};
        int64_t c = 0;
        for (; c + 32 <= cols; c += 32)
            for (int i = 0; i < 4; i++) {
                const v8 v = load8(op->a, at + c + 8 * i, bf16);
                acc[i] += v * v;
            }
        for (; c < cols; c += 8) {
            const v8 v = load8(op->a, at + c, bf16);
            acc[0] += v * v;
        }
        const float inv = 1.0f / sqrtf(hsum((acc[0] + acc[1]) + (acc[2] + acc[3])) / (float)cols + op->eps);
        for (c = 0; c < cols; c += 8) {
            const v8 normed = round8(load8(op->a, at + c, bf16) * inv, bf16);
            store8(op->out, r * cols + c, load8(op->b, c, bf16) * normed, bf16);
        }
    }
}

static void rms_f32(const Rows *op, int64_t lo, int64_t hi) { rms_rows(op, lo, hi, 0); }
static void rms_bf16(const Rows *op, int64_t lo, int64_t hi) { rms_rows(op, lo, hi, 1); }

void tidal_rms_norm(const void *x, const void *w, void *out, int64_t rows, int64_t cols, int64_t x_stride, float eps,
                    int64_t threads, int64_t bf16) {
    const Rows op = {.a = x, .b = w, .out = out, .cols = cols, .a_stride = x_stride, .eps = eps};
    over_rows(bf16 ? rms_bf16 : rms_f32, &op, rows, threads);
}

// x * sigmoid(x), sigmoid from e = exp(-|x|) <= 1 (no overflow): 1 / (1 + e) for x >= 0, else e / (1 + e)
static inline v8 silu8(v8 x) {
    const v8 e = exp8((v8)((u8)x | 0x80000000u));  // e^-|x|: the sign bit set
    const v8 num = (v8)(((i8)e & (x < 0)) | ((i8)((v8){0} + 1.0f) & ~(x < 0)));
    return x * num / (1.0f + e);
}

// out[r] = silu(g[r]) * u[r] for g = op->a, u = op->b, float32: SwiGLU's act(gate) * up. (In
// bfloat16 torch's two ops, 16 lanes wide under AVX-512, were as fast as this: not offered.)
static void silu_mul_rows(const Rows *op, int64_t lo, int64_t hi) {
    const float *g = op->a, *u = op->b;
    for (int64_t r = lo; r < hi; r++)
        for (int64_t c = 0; c < op->cols; c += 8) {
            const v8 act = silu8(*(const v8 *)(g + r * op->a_stride + c));
            *(v8 *)((float *)op->out + r * op->cols + c) = act * *(const v8 *)(u + r * op->b_stride + c);
        }
}

void tidal_silu_mul(const float *g, const float *u, float *out, int64_t rows, int64_t cols, int64_t g_stride,
                    int64_t u_stride, int64_t threads) {
    const Rows op = {.a = g, .b = u, .out = out, .cols = cols, .a_stride = g_stride, .b_stride = u_stride};
    over_rows(silu_mul_rows, &op, rows, threads);
}

// Rotary position embedding in the rotate-half layout, transformers' apply_rotary_pos_emb:
// out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[D/2:], x[:D/2]), each product and
// the sum rounded to the input's dtype as its three ops round them (so never fused into an FMA).
// x = op->a: rows of D = op->cols (a multiple of 16), a_stride apart; row r uses row r / heads of
// cos = op->b and sin = op->c (b_stride apart).
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("fp-contract=off")))
#endif
static inline void rotary_rows(const Rows *op, int64_t lo, int64_t hi, int bf16) {
    const int64_t half = op->cols / 2;
    for (int64_t r = lo; r < hi; r++) {
        const int64_t t = r / op->heads, x0 = t * op->token_stride + (r - t * op->heads) * op->a_stride;
        const int64_t cs = t * op->b_stride, o = r * op->cols;
        for (int64_t c = 0; c < half; c += 8) {
            const v8 x1 = load8(op->a, x0 + c, bf16), x2 = load8(op->a, x0 + half + c, bf16);
            const v8 cos1 = load8(op->b, cs + c, bf16), cos2 = load8(op->b, cs + half + c, bf16);
            const v8 sin1 = load8(op->c, cs + c, bf16), sin2 = load8(op->c, cs + half + c, bf16);
            store8(op->out, o + c, round8(x1 * cos1, bf16) + round8(-x2 * sin1, bf16), bf16);
            store8(op->out, o + half + c, round8(x2 * cos2, bf16) + round8(x1 * sin2, bf16), bf16);
        }
    }
}

static void rotary_f32(const Rows *op, int64_t lo, int64_t hi) { rotary_rows(op, lo, hi, 0); }
static void rotary_bf16(const Rows *op, int64_t lo, int64_t hi) { rotary_rows(op, lo, hi, 1); }

// x: T * heads rows of D (row t * heads + h: token t, head h), heads x_stride apart, tokens
// token_stride apart; cos, sin: T rows of D, cs_stride apart; out: [T * heads, D]
void tidal_rotary(const void *x, const void *cos, const void *sin, void *out, int64_t rows, int64_t heads, int64_t D,
                  int64_t x_stride, int64_t token_stride, int64_t cs_stride, int64_t threads, int64_t bf16) {
    const Rows op = {.a = x, .b = cos, .c = sin, .out = out, .cols = D, .a_stride = x_stride, .b_stride = cs_stride,
                     .heads = heads, .token_stride = token_stride};
    over_rows(bf16 ? rotary_bf16 : rotary_f32, &op, rows, threads);
}
