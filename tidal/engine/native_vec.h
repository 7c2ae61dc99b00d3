// Vector helpers shared by the native kernels (decode_attention.c, sample.c): eight floats at a
// time with GCC/Clang vector extensions (an AVX2 register; two SSE registers, or NEON pairs,
// elsewhere), float32 or bfloat16 memory read as float32.
#ifndef TIDAL_NATIVE_VEC_H
#define TIDAL_NATIVE_VEC_H
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include <math.h>
#include <stdint.h>

// The kernels' helpers take constants (element type, head count) that each caller's loops are
// specialised on: they must be inlined (GCC declined once the callers grew, 2x slower).
#define ALWAYS_INLINE static inline __attribute__((always_inline))

// Eight floats as one vector. The kernels keep several independent sums in flight: one sum's
// chain of FMAs would wait on each FMA's latency, several fill the pipeline. Rows are read
// unaligned.
typedef float v8 __attribute__((vector_size(32), aligned(4)));

typedef uint16_t h8 __attribute__((vector_size(16), aligned(2)));
typedef uint32_t u8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

// Eight elements from element offset `at` of `base`, as floats: float32, or bfloat16 widened
// (exact: bf16 is fp32's upper half). `bf16` is a constant at every call site, so the compiler
// makes a version of each caller per element type.
static inline v8 load8(const void *base, int64_t at, int bf16) {
    if (!bf16) return *(const v8 *)((const float *)base + at);
#ifdef __AVX2__  // one widening load and a shift (GCC splits the generic form below into halves)
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)base + at)));
    return (v8)_mm256_slli_epi32(wide, 16);
#else
    const u8 wide = __builtin_convertvector(*(const h8 *)((const uint16_t *)base + at), u8) << 16;
    return (v8)wide;
#endif
}

// Ask for the cache lines of the n elements from element offset `at` ahead of their use. A
// decode step's context rows lie scattered over the cache's blocks and, over all layers, far
// exceed the CPU's caches; asking 8 rows ahead made the kernel 1.3x faster on bf16 caches.
static inline void prefetch_row(const void *base, int64_t at, int64_t n, int bf16) {
    const char *row = (const char *)base + at * (bf16 ? 2 : 4);
    for (int64_t byte = 0; byte < n * (bf16 ? 2 : 4); byte += 64) __builtin_prefetch(row + byte);
}

// f rounded to bfloat16, to nearest even (NaN stays NaN), as torch rounds
static inline uint16_t to_bf16(float f) {
    union {
        float f;
        uint32_t u;
    } w = {.f = f};
    if ((w.u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((w.u + 0x7fffu + ((w.u >> 16) & 1u)) >> 16);
}

static inline float hsum(v8 x) {
    return ((x[0] + x[4]) + (x[1] + x[5])) + ((x[2] + x[6]) + (x[3] + x[7]));
}

// e^x for x <= 0, eight at a time (libm's expf is scalar, and one exp per score was most of the
// kernel's time): e^x = 2^i * e^r with i = round(x / ln 2), r = x - i ln 2 in [-ln2/2, ln2/2], e^r
// by Cephes' degree-7 polynomial for expf (~1 ulp); x < -87 (e^x below float's normal range) gives 0.
static inline v8 exp8(v8 x) {
    const v8 fx = x * 1.44269504088896341f + 0.5f;
    v8 fl = __builtin_convertvector(__builtin_convertvector(fx, i8), v8);  // truncation
    fl -= __builtin_convertvector(-(fl > fx), v8);                       // ... made floor
    const v8 r = x - fl * 0.693359375f + fl * 2.12194440e-4f;
    v8 p = 1.9875691500e-4f * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    const i8 bits = (__builtin_convertvector(fl, i8) + 127) << 23;  // 2^i; garbage where x < -87 ...
    return (v8)((i8)(p * (v8)bits) & (x >= -87.0f));              // ... masked to 0 (NaN too)
}

// Element v of `base` (float32 or bfloat16), as a float
static inline float elem(const void *base, int64_t v, int bf16) {
    if (!bf16) return ((const float *)base)[v];
    union {
        uint32_t u;
        float f;
    } w = {.u = (uint32_t)((const uint16_t *)base)[v] << 16};
    return w.f;
}

// sum over v in [lo, hi) of e_v = exp((z_v - m) * inv_t), for z_v <= m; when `w` is given, each e_v
// is also written to w[v - lo] (w may be z itself, float32, lo = 0: the weights then replace it)
static inline float exp_sum(const void *z, int64_t lo, int64_t hi, float m, float inv_t, float *w, int bf16) {
    v8 acc = {0};
    int64_t v = lo;
    for (; v + 8 <= hi; v += 8) {
        const v8 e = exp8((load8(z, v, bf16) - m) * inv_t);
        if (w) *(v8 *)(w + v - lo) = e;
        acc += e;
    }
    float sum = hsum(acc);
    for (; v < hi; v++) {
        const float e = expf((elem(z, v, bf16) - m) * inv_t);
        if (w) w[v - lo] = e;
        sum += e;
    }
    return sum;
}
#endif
