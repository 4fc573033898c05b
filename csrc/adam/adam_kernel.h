/*
 * Internal to inf_adam: what the driver (adam.c) hands the per-ISA inner loops
 * (adam_scalar.c, adam_avx2.c, adam_avx512.c), and the scalar element update that the scalar
 * loop runs everywhere and the SIMD loops run on their tails. Names with `inf_adam__` are not
 * part of the API.
 *
 * [Note: one formula] Every path computes exactly the sequence documented in inf_adam.h with
 * the same roundings: each multiply, add, divide and sqrt is one IEEE float operation, and the
 * three fused multiply-adds are single-rounding in every path (fmaf here, vfmadd in SIMD).
 * The build passes -ffp-contract=off so the compiler never fuses anything else.
 */
#ifndef INF_ADAM_KERNEL_H
#define INF_ADAM_KERNEL_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "inf_adam.h"

/* Float coefficients of one step, each rounded from double once (see inf_adam.h). */
struct inf_adam__coef {
    float grad_scale;
    float weight_decay;   /* L2 term, used when l2 */
    float decay;          /* 1 - lr * wd, used when decoupled */
    float lerp_w;         /* 1 - beta1, or (1 - beta1) - 1 when lerp_big */
    float beta2;
    float one_minus_beta2;
    float bc2_sqrt;       /* sqrt(1 - beta2^step) */
    float eps;
    float step_size;      /* lr / (1 - beta1^step) */
    int l2;               /* Adam with weight_decay != 0 */
    int decoupled;        /* AdamW with weight_decay != 0 */
    int lerp_big;         /* 1 - beta1 >= 0.5: torch's lerp anchors on g instead of m */
};

/* The arrays of one call; grad and out types are enum inf_adam_dtype. */
struct inf_adam__arrays {
    float *param;
    const void *grad;
    float *exp_avg;
    float *exp_avg_sq;
    void *out;
    int grad_dtype;
    int out_dtype;
    int stream_out;       /* write out with non-temporal stores where aligned (large arrays) */
};

/* Update elements [lo, hi). */
typedef void (*inf_adam__range_fn)(const struct inf_adam__coef *c,
                                   const struct inf_adam__arrays *a, size_t lo, size_t hi);

/* One work item [lo, hi) of a call; ctx is the call's. */
typedef void (*inf_adam__work_fn)(const void *ctx, size_t lo, size_t hi);

/* Split [0, n) into items, each a multiple of `align` elements (itself a multiple of 64) but
 * the last, and run them on the calling thread plus up to threads - 1 of the pool's workers
 * (none without a pool); how many join never changes the result. Defined in adam.c. */
void inf_adam__run(inf_adam__work_fn work, const void *ctx, size_t n, size_t align, int threads,
                   struct inf_pool *pool);

/* Argument checks shared by the drivers (adam.c): bytes of an enum inf_adam_dtype element
 * (0 for NONE or an unknown value), and whether a pointer or two byte ranges are bad. */
size_t inf_adam__dtype_size(int dtype);
int inf_adam__misaligned(const void *ptr, size_t align);
int inf_adam__overlap(const void *a, size_t an, const void *b, size_t bn);

void inf_adam__range_scalar(const struct inf_adam__coef *c, const struct inf_adam__arrays *a,
                            size_t lo, size_t hi);
#if defined(__x86_64__) || defined(__i386__)
void inf_adam__range_avx2(const struct inf_adam__coef *c, const struct inf_adam__arrays *a,
                          size_t lo, size_t hi);
void inf_adam__range_avx512(const struct inf_adam__coef *c, const struct inf_adam__arrays *a,
                            size_t lo, size_t hi);
#endif

/* The double accumulators of inf_adam_sum_squares ([Note: one sum on every path] in
 * sum_squares.c): element i of the array goes into lane i % INF_ADAM__SUMSQ_LANES. */
#define INF_ADAM__SUMSQ_LANES 32
#if defined(__x86_64__) || defined(__i386__)
/* Adds the squares of x's whole blocks of INF_ADAM__SUMSQ_LANES elements into acc, lane by
 * lane; returns how many elements that was (the caller's scalar loop takes the rest). */
size_t inf_adam__sum_squares_avx2(const void *x, int dtype, size_t n, double *acc);
size_t inf_adam__sum_squares_avx512(const void *x, int dtype, size_t n, double *acc);
#endif

static inline uint32_t inf_adam__f32_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof(u));
    return u;
}

static inline float inf_adam__bits_f32(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof(f));
    return f;
}

static inline float inf_adam__bf16_to_f32(uint16_t h)
{
    return inf_adam__bits_f32((uint32_t)h << 16);
}

/* See [Note: lowp rounding] in inf_adam.h. */
static inline uint16_t inf_adam__f32_to_bf16(float f)
{
    uint32_t u = inf_adam__f32_bits(f);

    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Exact; a signalling NaN comes back quiet, as from F16C's vcvtph2ps. */
static inline float inf_adam__f16_to_f32(uint16_t h)
{
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;

    if (exp == 0x1f)
        return inf_adam__bits_f32(sign | 0x7f800000u | (man << 13) | (man ? 0x00400000u : 0));
    if (exp == 0) {
        if (man == 0)
            return inf_adam__bits_f32(sign);
        /* subnormal: man * 2^-24, exact in float */
        exp = 113;
        while (!(man & 0x400u)) {
            man <<= 1;
            exp--;
        }
        return inf_adam__bits_f32(sign | (exp << 23) | ((man & 0x3ffu) << 13));
    }
    return inf_adam__bits_f32(sign | ((exp + 112) << 23) | (man << 13));
}

/* See [Note: lowp rounding] in inf_adam.h; equals vcvtps2ph with round-to-nearest-even. */
static inline uint16_t inf_adam__f32_to_f16(float f)
{
    uint32_t u = inf_adam__f32_bits(f);
    uint32_t sign = (u >> 16) & 0x8000u;
    uint32_t ax = u & 0x7fffffffu;
    uint32_t shift, man, q, rem, half;

    if (ax > 0x7f800000u)                          /* NaN */
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u)                         /* >= 65520 (or inf) rounds to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (ax >= 0x38800000u) {                       /* normal half: >= 2^-14 */
        ax += 0x0fffu + ((ax >> 13) & 1u);
        return (uint16_t)(sign | ((ax - (112u << 23)) >> 13));
    }
    if (ax < 0x33000001u)                          /* <= 2^-25 rounds to zero (tie to even) */
        return (uint16_t)sign;
    /* subnormal half: |f| / 2^-24 = man * 2^-shift with shift in [14, 24] */
    shift = 126u - (ax >> 23);
    man = (ax & 0x7fffffu) | 0x800000u;
    q = man >> shift;
    rem = man & ((1u << shift) - 1u);
    half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u)))
        q++;
    return (uint16_t)(sign | q);
}

static inline float inf_adam__load_grad(const struct inf_adam__arrays *a, size_t i)
{
    switch (a->grad_dtype) {
    case INF_ADAM_DTYPE_BF16:
        return inf_adam__bf16_to_f32(((const uint16_t *)a->grad)[i]);
    case INF_ADAM_DTYPE_F16:
        return inf_adam__f16_to_f32(((const uint16_t *)a->grad)[i]);
    default:
        return ((const float *)a->grad)[i];
    }
}

/* Elements ahead of the current one the SIMD loops ask the cache for. The hardware prefetchers
 * follow each stream on their own, but with a long chain of divides and square roots in flight
 * the core issues its loads too late to keep memory busy; asking 1 KiB ahead per float stream
 * made a 50M-element step about 10% faster on the dev VM (see docs/performance.md). */
#define INF_ADAM__PREFETCH_AHEAD 256

/* Ask for the cache lines of element i + INF_ADAM__PREFETCH_AHEAD of every input stream. A
 * prefetch never faults, so running past the end of the arrays is harmless; the addresses are
 * formed as integers because such a pointer would not be valid C. */
static inline void inf_adam__prefetch(const struct inf_adam__arrays *a, size_t i)
{
    uintptr_t fbytes = (uintptr_t)(i + INF_ADAM__PREFETCH_AHEAD) * sizeof(float);
    uintptr_t gbytes = a->grad_dtype == INF_ADAM_DTYPE_F32 ? fbytes : fbytes / 2;

    __builtin_prefetch((const void *)((uintptr_t)a->param + fbytes), 0, 3);
    __builtin_prefetch((const void *)((uintptr_t)a->exp_avg + fbytes), 0, 3);
    __builtin_prefetch((const void *)((uintptr_t)a->exp_avg_sq + fbytes), 0, 3);
    __builtin_prefetch((const void *)((uintptr_t)a->grad + gbytes), 0, 3);
}

/* One element of the step; see [Note: one formula]. */
static inline void inf_adam__update_one(const struct inf_adam__coef *c,
                                        const struct inf_adam__arrays *a, size_t i)
{
    float g = inf_adam__load_grad(a, i) * c->grad_scale;
    float p = a->param[i];
    float m = a->exp_avg[i];
    float v = a->exp_avg_sq[i];
    float d;

    if (c->l2)
        g = fmaf(p, c->weight_decay, g);
    if (c->decoupled)
        p = p * c->decay;
    m = fmaf(c->lerp_w, g - m, c->lerp_big ? g : m);
    v = fmaf(c->one_minus_beta2 * g, g, v * c->beta2);
    d = sqrtf(v) / c->bc2_sqrt + c->eps;
    p = p - (c->step_size * m) / d;

    a->param[i] = p;
    a->exp_avg[i] = m;
    a->exp_avg_sq[i] = v;
    if (a->out_dtype == INF_ADAM_DTYPE_BF16)
        ((uint16_t *)a->out)[i] = inf_adam__f32_to_bf16(p);
    else if (a->out_dtype == INF_ADAM_DTYPE_F16)
        ((uint16_t *)a->out)[i] = inf_adam__f32_to_f16(p);
}

#endif /* INF_ADAM_KERNEL_H */
