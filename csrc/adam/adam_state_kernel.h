/*
 * Internal to inf_adam_state_step: what the driver (adam_state.c) hands the per-ISA loops
 * (adam_scalar.c, and adam_state_simd_body.h in adam_avx2.c and adam_avx512.c), and the scalar
 * pieces of one element that the scalar loop runs everywhere and the SIMD loops run on their
 * tails. Every path computes the formula of inf_adam.h with the same roundings; the build's
 * -ffp-contract=off keeps the compiler from fusing any multiply and add.
 *
 * [Note: 8-bit moments] A block of moments is stored as one float scale and one byte per
 * element. The scale is the block's largest magnitude (0 for an all-zero block; NaN for a block
 * holding an inf or NaN, whose bytes are then 0 and decode to NaN). Each element is coded from
 * y = x * (1 / scale), or x / scale where the scale or its inverse is not a normal float
 * (|y| <= 1 but for an ulp, and the largest rounds to 1) as an 8-bit float without inf or NaN
 * codes whose top exponent is 1.0: exp_avg with a sign bit, 3 exponent and 4 mantissa bits;
 * exp_avg_sq without a sign, 4 exponent and 4 mantissa bits (codes above 1.0 go unused). y
 * rounds to the nearest code, ties to the even code (below the normal codes through a float
 * subnormal first: see inf_adam__q8_encode_magnitude), and a positive exp_avg_sq never rounds to
 * 0 but to the smallest code: a zero there would turn m / sqrt(v) into m / eps. A byte decodes
 * to its value times the scale (one multiply), so a block's largest element comes back exactly
 * and its decay by beta2 is kept exactly in the float scale (8-bit codes alone could not hold
 * a change of 0.1% a step). infinity/optim/_quant.py states the same rules in torch;
 * docs/store.md says why these maps and the block size.
 *
 * [Note: no float subnormals] A subnormal code's bits at the top of a float make a float
 * subnormal, and so does |y| * 2^(bias - 127) for a y below the normal codes; a multiply that
 * reads or makes one takes a microcode assist on Intel cores (over 100 cycles), and with the
 * E3M4 / E4M4 maps many vectors of a block hold such a code (with normally distributed
 * moments the 8-bit formats ran 4-4.5x slower for it on the Intel Xeon dev VM, every ISA). So
 * no path forms a float subnormal while decoding or coding, and every path gets the bits the
 * multiplies would (checked for every float |y| <= 2): the scalar decode takes a subnormal
 * code's mantissa times its step, the SIMD decode widens the codes through fp16
 * (adam_state_simd_body.h: F16C takes fp16 subnormals in hardware), and coding finds t's bits
 * as inf_adam__q8_encode_magnitude says.
 *
 * [Note: stochastic rounding] Without a master, the new parameter p (float) is rounded to the
 * 16-bit values up or down at random, with the probability of rounding away from zero equal to
 * the fraction of the gap between the two neighbours that p covers (to 2^-16 for bf16, 2^-13
 * for fp16), so updates far below the values' precision still move them on average. The
 * 16 random bits r of element i are the top half of (lo(j) ^ key) * 0x9e3779b1 mod 2^32, with
 * j = index + i, lo and hi its 32-bit halves, key = key0 ^ mix32(hi(j) ^ key1), mix32 a 32-bit
 * integer hash and the keys from (seed, step): a function of the element and the step only.
 * What rounding needs is that each element's r is uniform and independent from step to step:
 * key0 is new random bits every step, so lo(j) ^ key is uniform, and so is its product with an
 * odd constant and the product's top half. Within a step, consecutive elements' r are spread
 * evenly over [0, 2^16) (a Weyl sequence, scrambled by the xor) rather than independent, which
 * keeps the mean of many roundings closer to its expectation. One multiply where a full hash
 * of each element took two: the master-free kernels run 3-8% faster for it
 * (docs/performance.md). bf16: r is added to p's bits below bf16 precision, then cut off.
 * fp16: the same with r's low 13 bits; |p| under 2^-14 (fp16 subnormals, spaced 2^-24) is
 * first shifted up by adding 2^-14, so it has the spacing of the binade above, and shifted back
 * after. inf and NaN round to nearest as the master's copy does; a finite p past the largest
 * 16-bit value may round to inf.
 */
#ifndef INF_ADAM_STATE_KERNEL_H
#define INF_ADAM_STATE_KERNEL_H

#include <float.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>

#include "adam_kernel.h"

/* The two 8-bit maps: mantissa bits and exponent bias (the top exponent field: 2^bits - 1). */
#define INF_ADAM__QM_MAN 4
#define INF_ADAM__QM_BIAS 7
#define INF_ADAM__QV_MAN 4
#define INF_ADAM__QV_BIAS 15
/* Elements per work unit of the 16- and 32-bit formats (8-bit ones use their block size). */
#define INF_ADAM__STATE_UNIT 512

/* Float coefficients of one step, each rounded from double once, and the rounding key. */
struct inf_adam__state_coef {
    float grad_scale;
    float weight_decay;      /* L2 term, used when l2 */
    float decay;             /* 1 - lr * wd, used when decoupled */
    float beta1;
    float one_minus_beta1;
    float beta2;
    float one_minus_beta2;
    float inv_bc2_sqrt;      /* 1 / sqrt(1 - beta2^step) */
    float eps;
    float step_size;         /* lr / (1 - beta1^step) */
    int l2;
    int decoupled;
    uint32_t key0;           /* [Note: stochastic rounding] */
    uint32_t key1;
};

/* One block (8-bit) or work unit of a segment: elements [lo, hi), their gradient from grad
 * (element lo first: in its piece, or gathered from several as float), room for the new
 * moments, and for 8-bit moments the block's stored scales. */
struct inf_adam__block {
    size_t lo;
    size_t hi;
    const void *grad;
    int grad_dtype;          /* enum inf_adam_dtype */
    float *m;
    float *v;
    float m_scale;
    float v_scale;
};

/* What an 8-bit block's update saw of its new moments: the largest |m| and |v| as float bits.
 * For non-negative floats the integer order is the float order, and every inf and NaN lies
 * above every finite value, so one integer max tracks both the scale and a bad block. */
struct inf_adam__amax {
    uint32_t m;
    uint32_t v;
};

/* The loops of one instruction set. */
struct inf_adam__state_isa {
    /* dst[k] = float(src[k]) for k < n; src has type dtype */
    void (*convert)(float *dst, const void *src, int dtype, size_t n);
    /* update the elements of n consecutive blocks b[k]; 8-bit moments go to b[k].m, b[k].v
     * and amax[k] */
    void (*update)(const struct inf_adam__state_coef *c, const struct inf_adam_segment *s,
                   const struct inf_adam__block *b, size_t n, struct inf_adam__amax *amax);
    /* code n moments of one block (scale > 0, finite; inv from inf_adam__q8_inverse) */
    void (*encode_m)(uint8_t *dst, const float *src, size_t n, float scale, float inv);
    void (*encode_v)(uint8_t *dst, const float *src, size_t n, float scale, float inv);
};

extern const struct inf_adam__state_isa inf_adam__state_scalar;
#if defined(__x86_64__) || defined(__i386__)
extern const struct inf_adam__state_isa inf_adam__state_avx2;
extern const struct inf_adam__state_isa inf_adam__state_avx512;
#endif

static inline uint32_t inf_adam__mix32(uint32_t x)
{
    x ^= x >> 16;
    x *= 0x7feb352du;
    x ^= x >> 15;
    x *= 0x846ca68bu;
    x ^= x >> 16;
    return x;
}

/* The part of the random bits shared by the 2^32 elements whose counters have high half hi. */
static inline uint32_t inf_adam__random_key(const struct inf_adam__state_coef *c, uint32_t hi)
{
    return c->key0 ^ inf_adam__mix32(hi ^ c->key1);
}

/* The multiplier of [Note: stochastic rounding]: odd, 2^32 / the golden ratio. */
#define INF_ADAM__ROUNDING_MUL 0x9e3779b1u

/* [Note: stochastic rounding] the 16 random bits of element counter j */
static inline uint32_t inf_adam__random(const struct inf_adam__state_coef *c, uint64_t j)
{
    uint32_t key = inf_adam__random_key(c, (uint32_t)(j >> 32));

    return (((uint32_t)j ^ key) * INF_ADAM__ROUNDING_MUL) >> 16;
}

static inline uint16_t inf_adam__sr_bf16(float p, uint32_t r)
{
    uint32_t u = inf_adam__f32_bits(p);

    if (p != p)
        return inf_adam__f32_to_bf16(p);
    /* |p| <= FLT_MAX or inf: adding 16 bits never reaches the sign; inf stays inf */
    return (uint16_t)((u + r) >> 16);
}

static inline uint16_t inf_adam__sr_f16(float p, uint32_t r)
{
    const float low = 0x1p-14f;  /* the smallest normal fp16 */
    float a = fabsf(p), b, t;

    if (!(a <= FLT_MAX))
        return inf_adam__f32_to_f16(p);
    b = a < low ? a + low : a;
    t = inf_adam__bits_f32((inf_adam__f32_bits(b) + (r & 0x1fffu)) & ~0x1fffu);
    if (a < low)
        t = t - low;
    return inf_adam__f32_to_f16(copysignf(t, p));
}

/* A block's scale from its largest magnitude's bits: that magnitude, NaN if the block holds an
 * inf or NaN. */
static inline float inf_adam__q8_scale(uint32_t amax)
{
    return amax >= 0x7f800000u ? NAN : inf_adam__bits_f32(amax);
}

static inline uint32_t inf_adam__max_u32(uint32_t a, uint32_t b)
{
    return a > b ? a : b;
}

/* Value of an 8-bit magnitude code with `man` mantissa bits and exponent bias `bias`: a normal
 * code's bits as the top of a float whose exponent is moved up by 127 - bias, a subnormal
 * code's mantissa times the code step 2^(1 - bias - man); both exact. [Note: no float
 * subnormals] */
static inline float inf_adam__q8_magnitude(uint32_t mag, int man, int bias)
{
    if (mag >> man == 0)
        return (float)mag * inf_adam__bits_f32((uint32_t)(127 + 1 - bias - man) << 23);
    return inf_adam__bits_f32((mag << (23 - man)) + ((uint32_t)(127 - bias) << 23));
}

static inline float inf_adam__q8_decode_m(uint8_t code, float scale)
{
    float mag = inf_adam__q8_magnitude(code & 0x7fu, INF_ADAM__QM_MAN, INF_ADAM__QM_BIAS);

    return (code & 0x80u ? -mag : mag) * scale;
}

static inline float inf_adam__q8_decode_v(uint8_t code, float scale)
{
    return inf_adam__q8_magnitude(code, INF_ADAM__QV_MAN, INF_ADAM__QV_BIAS) * scale;
}

/* The magnitude code of |y| <= 1: t = |y| * 2^(bias - 127) has the code's exponent in its own
 * (subnormal codes as float subnormals, t rounded to them first), and its bits rounded to
 * `man` mantissa bits, nearest, ties to even, are the code (clamped to max_code, which only
 * bounds what the rules never make). t's bits are found without forming t ([Note: no float
 * subnormals]): where t is normal they are |y|'s less (127 - bias) << 23, where it is
 * subnormal those of |y| + 2^(1 - bias) (whose ulp is t's subnormal step, so the sum rounds as
 * t does) less 2^(1 - bias)'s, and the larger of the two is always the right one. */
static inline uint32_t inf_adam__q8_encode_magnitude(float mag, int man, int bias,
                                                     uint32_t max_code)
{
    const int shift = 23 - man;
    float low = mag + inf_adam__bits_f32((uint32_t)(128 - bias) << 23);
    uint32_t bits = inf_adam__max_u32(inf_adam__f32_bits(low) - (1u << 23),
                                      inf_adam__f32_bits(mag)) - ((uint32_t)(127 - bias) << 23);
    uint32_t code = (bits + (1u << (shift - 1)) - 1u + ((bits >> shift) & 1u)) >> shift;

    return code > max_code ? max_code : code;
}

/* 1 / scale where both are normal floats (y = x * inv is then within an ulp of x / scale and
 * never overflows), else 0: y = x / scale. One divide per block instead of one per element. */
static inline float inf_adam__q8_inverse(float scale)
{
    return scale >= FLT_MIN && scale <= 0x1p126f ? 1.0f / scale : 0.0f;
}

static inline float inf_adam__q8_normalize(float x, float scale, float inv)
{
    return inv != 0.0f ? x * inv : x / scale;
}

static inline uint8_t inf_adam__q8_encode_m(float x, float scale, float inv)
{
    float y = inf_adam__q8_normalize(x, scale, inv);
    uint32_t code = inf_adam__q8_encode_magnitude(fabsf(y), INF_ADAM__QM_MAN, INF_ADAM__QM_BIAS,
                                                  0x7fu);

    return (uint8_t)(code | ((inf_adam__f32_bits(y) >> 24) & 0x80u));
}

static inline uint8_t inf_adam__q8_encode_v(float x, float scale, float inv)
{
    float mag = fabsf(inf_adam__q8_normalize(x, scale, inv));
    uint32_t code = inf_adam__q8_encode_magnitude(mag, INF_ADAM__QV_MAN, INF_ADAM__QV_BIAS,
                                                  0xffu);

    return (uint8_t)(code == 0 && mag > 0.0f ? 1u : code);
}

static inline float inf_adam__load_16(const void *src, int dtype, size_t i)
{
    uint16_t h = ((const uint16_t *)src)[i];

    return dtype == INF_ADAM_DTYPE_BF16 ? inf_adam__bf16_to_f32(h) : inf_adam__f16_to_f32(h);
}

/* Element i of an array of enum inf_adam_dtype F32, BF16 or F16, as float (exact). */
static inline float inf_adam__load_any(const void *src, int dtype, size_t i)
{
    return dtype == INF_ADAM_DTYPE_F32 ? ((const float *)src)[i] : inf_adam__load_16(src, dtype, i);
}

static inline uint16_t inf_adam__round_16(float p, int dtype)
{
    return dtype == INF_ADAM_DTYPE_BF16 ? inf_adam__f32_to_bf16(p) : inf_adam__f32_to_f16(p);
}

/* The parameter before the step: the master's, or the 16-bit values widened. */
static inline float inf_adam__load_param(const struct inf_adam_segment *s, size_t i)
{
    return s->master ? s->master[i] : inf_adam__load_16(s->values, s->values_dtype, i);
}

/*
 * An element's update in two pieces: its moments, then its parameter from the new moments.
 * The scalar loop runs each piece over the whole block; the SIMD loops run both on each vector
 * in one pass and these on their tails. Elementwise either way: the formula of inf_adam.h.
 */

/* The moments of element i: the new m and v into b->m, b->v; stored as bf16 or float here
 * (8-bit ones are coded after the block), their largest magnitude noted in amax for 8-bit
 * ones. */
static inline void inf_adam__moments_one(const struct inf_adam__state_coef *c,
                                         const struct inf_adam_segment *s,
                                         const struct inf_adam__block *b, size_t i,
                                         struct inf_adam__amax *amax)
{
    size_t k = i - b->lo;
    float g = inf_adam__load_any(b->grad, b->grad_dtype, k) * c->grad_scale, m, v;

    if (s->moments == INF_ADAM_MOMENTS_F32) {
        m = ((const float *)s->exp_avg)[i];
        v = ((const float *)s->exp_avg_sq)[i];
    } else if (s->moments == INF_ADAM_MOMENTS_BF16) {
        m = inf_adam__bf16_to_f32(((const uint16_t *)s->exp_avg)[i]);
        v = inf_adam__bf16_to_f32(((const uint16_t *)s->exp_avg_sq)[i]);
    } else {
        m = inf_adam__q8_decode_m(((const uint8_t *)s->exp_avg)[i], b->m_scale);
        v = inf_adam__q8_decode_v(((const uint8_t *)s->exp_avg_sq)[i], b->v_scale);
    }
    if (c->l2)
        g = g + c->weight_decay * inf_adam__load_param(s, i);
    m = c->beta1 * m + c->one_minus_beta1 * g;
    v = c->beta2 * v + (c->one_minus_beta2 * g) * g;
    b->m[k] = m;
    b->v[k] = v;

    if (s->moments == INF_ADAM_MOMENTS_F32) {
        ((float *)s->exp_avg)[i] = m;
        ((float *)s->exp_avg_sq)[i] = v;
    } else if (s->moments == INF_ADAM_MOMENTS_BF16) {
        ((uint16_t *)s->exp_avg)[i] = inf_adam__f32_to_bf16(m);
        ((uint16_t *)s->exp_avg_sq)[i] = inf_adam__f32_to_bf16(v);
    } else {
        amax->m = inf_adam__max_u32(amax->m, inf_adam__f32_bits(fabsf(m)));
        amax->v = inf_adam__max_u32(amax->v, inf_adam__f32_bits(fabsf(v)));
    }
}

/* The parameter of element i from its new moments in b->m, b->v. */
static inline void inf_adam__param_one(const struct inf_adam__state_coef *c,
                                       const struct inf_adam_segment *s,
                                       const struct inf_adam__block *b, size_t i)
{
    size_t k = i - b->lo;
    float p = inf_adam__load_param(s, i), d;

    if (c->decoupled)
        p = p * c->decay;
    d = sqrtf(b->v[k]) * c->inv_bc2_sqrt + c->eps;
    p = p - (c->step_size * b->m[k]) / d;

    if (s->master) {
        s->master[i] = p;
        if (s->values_dtype != INF_ADAM_DTYPE_NONE)
            ((uint16_t *)s->values)[i] = inf_adam__round_16(p, s->values_dtype);
    } else {
        uint32_t r = inf_adam__random(c, s->index + i);

        ((uint16_t *)s->values)[i] = s->values_dtype == INF_ADAM_DTYPE_BF16
                                         ? inf_adam__sr_bf16(p, r)
                                         : inf_adam__sr_f16(p, r);
    }
}

#endif /* INF_ADAM_STATE_KERNEL_H */
