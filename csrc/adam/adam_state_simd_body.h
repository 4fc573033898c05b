/*
 * The SIMD loops of inf_adam_state_step, written once for every vector width; see
 * adam_state_kernel.h for the formula and its notes. Included once by each ISA adapter
 * (adam_avx2.c, adam_avx512.c) after adam_simd_body.h, which brings the float operations; the
 * adapter also defines
 *
 *   vec_i32                   a vector of as many 32-bit integers as vec_f32 has floats
 *   vec_mask                  the result of a comparison, one flag per lane
 *   vec_abs                   |x|
 *   vec_as_i32, vec_as_f32    the same bits as the other type
 *   vec_i32_set1, _add, _and, _or, _xor, _mullo (low 32 bits), _min, _max (signed),
 *   vec_i32_srli, _slli       shift each lane by a constant (logical)
 *   vec_i32_hmax              the largest lane (signed)
 *   vec_iota                  0, 1, 2, ... one per lane
 *   vec_lt                    ordered float comparison
 *   vec_not_le(x, y)          !(x <= y): true for a NaN lane
 *   vec_is_nan(x)
 *   vec_mask_any
 *   vec_select, vec_i32_select (mask, where true, where false)
 *   vec_load_u8_u16           as many bytes as lanes, widened to a vec_u16
 *   vec_load_s8_u16           the same, sign-extended
 *   vec_u16_set1, _and, _slli on the 16-bit lanes of a vec_u16
 *   vec_from_f16              fp16 lanes of a vec_u16 widened to float (exact)
 *   vec_store_u8              lanes in [0, 2^31) narrowed to bytes, min(x, 255) (saturating)
 *   vec_store_u8x4_signs(dst, code, y)    the same for four vectors code[0..3] (lanes in
 *                             [0, 0x7f]) stored one after the other, with bit 7 set where the
 *                             lane of y[0..3] has its sign bit set
 *   vec_store_u8x4_nonzero(dst, code, y)  the same with any lane in [0, 2^31), each byte at
 *                             least 1 where the lane of y[0..3] (floats >= +0) is not 0
 *   vec_bf16_bits             32-bit lanes of the bf16 rounding of [Note: lowp rounding]
 *   vec_pack_u16              narrow 32-bit lanes (values <= 0xffff) to a vec_u16
 *   vec_pack_hi16             the top 16 bits of each 32-bit lane, as a vec_u16
 *   vec_store_u16x2(a, b, x, y) the same for two vectors, stored at a and at b
 *   INF_ADAM__SIMD_FN         `static` with the ISA's target attribute
 *   INF_ADAM__SPLIT_Q8        1: 8-bit moments update in two passes ([Note: 8-bit update in
 *                             two passes]); 0: in one
 *
 * and gets the static state_convert, state_update, state_encode_m and state_encode_v that its
 * exported table inf_adam__state_<isa> points to.
 */
#ifndef INF_ADAM__SIMD_WIDTH
#error "adam_state_simd_body.h is included after adam_simd_body.h by an ISA adapter"
#endif
#ifndef INF_ADAM__SPLIT_Q8
#error "the ISA adapter says whether 8-bit moments update in two passes (INF_ADAM__SPLIT_Q8)"
#endif

#include "adam_state_kernel.h"

INF_ADAM__SIMD_INLINE vec_f32 st_load_16(const void *src, int dtype, size_t i)
{
    if (dtype == INF_ADAM_DTYPE_BF16)
        return vec_load_bf16((const uint16_t *)src + i);
    return vec_load_f16((const uint16_t *)src + i);
}

/* x's bits plus the bf16 rounding's increment, nearest even ([Note: lowp rounding] in
 * inf_adam.h): the bf16 bits are its top 16, right for every lane but a NaN, without the
 * comparison and blend a NaN lane costs on every vector (the loop checks for NaN once). */
INF_ADAM__SIMD_INLINE vec_i32 st_bf16_round(vec_f32 x)
{
    vec_i32 u = vec_as_i32(x);

    return vec_i32_add(vec_i32_add(u, vec_i32_set1(0x7fff)),
                       vec_i32_and(vec_i32_srli(u, 16), vec_i32_set1(1)));
}

/* The bf16 bits of x's lanes in 32-bit lanes: `exact`, vec_bf16_bits; else st_bf16_round's. */
INF_ADAM__SIMD_INLINE vec_i32 st_bf16_bits(vec_f32 x, int exact)
{
    return exact ? vec_bf16_bits(x) : vec_i32_srli(st_bf16_round(x), 16);
}

/* [Note: no float subnormals] A code's magnitude bits at the top of an fp16's 15 (10 mantissa
 * bits) make an fp16 of value magnitude * 2^(bias - 15), subnormal codes as fp16 subnormals,
 * which F16C widens to normal floats in hardware; times 2^(15 - bias) (exact) that is the
 * magnitude inf_adam__q8_magnitude makes. fp16 holds every code of a map with at most 10
 * mantissa and 4 exponent bits (its top exponent field, 31, is inf and NaN). The decodes take
 * the block's scale times 2^(15 - bias) (q8_f16_scale): one multiply instead of two, the same
 * product where that is finite, and update_block sends the blocks where it is not to the
 * scalar loop. */
_Static_assert(INF_ADAM__QM_MAN <= 10 && INF_ADAM__QV_MAN <= 10 && INF_ADAM__QM_BIAS <= 15 &&
               INF_ADAM__QV_BIAS <= 15, "8-bit codes decode through fp16");

static inline float q8_f16_scale(float scale, int bias)
{
    return scale * inf_adam__bits_f32((uint32_t)(127 + 15 - bias) << 23);
}

/* Whether q8_f16_scale of a block's scale is finite (or NaN, for a NaN block). */
static inline int q8_f16_scale_fits(float scale, int bias)
{
    return !(scale > FLT_MAX * inf_adam__bits_f32((uint32_t)(127 - 15 + bias) << 23));
}

/* The code sign-extended to 16 bits and shifted as above has its sign bit in fp16's sign bit
 * and above the magnitude: the mask keeps the sign and the magnitude, so a negative code is
 * -magnitude (-0 for 0x80), as inf_adam__q8_decode_m says (scaling is symmetric in the sign).
 * `scale`: q8_f16_scale's. */
INF_ADAM__SIMD_INLINE vec_f32 q8_decode_m(const uint8_t *src, vec_f32 scale)
{
    const int shift = 10 - INF_ADAM__QM_MAN;
    vec_u16 h = vec_u16_and(vec_u16_slli(vec_load_s8_u16(src), shift),
                            vec_u16_set1((int16_t)(0x8000u | (0x7fu << shift))));

    return vec_mul(vec_from_f16(h), scale);
}

INF_ADAM__SIMD_INLINE vec_f32 q8_decode_v(const uint8_t *src, vec_f32 scale)
{
    vec_u16 h = vec_u16_slli(vec_load_u8_u16(src), 10 - INF_ADAM__QV_MAN);

    return vec_mul(vec_from_f16(h), scale);
}

/* See inf_adam__q8_encode_magnitude, without its clamp to max_code: the caller's saturating
 * narrow to bytes (vec_store_u8) clamps to 0xff, and m's magnitude codes, from |y| <= 1 but
 * for an ulp, never pass 0x7f (as the scalar clamp says: it bounds what the rules never make).
 * `bits` is t's bits plus (127 - bias) << 23, a multiple of the rounding's unit taken off with
 * its bias. */
INF_ADAM__SIMD_INLINE vec_i32 q8_encode_magnitude(vec_f32 mag, int man, int bias)
{
    const int shift = 23 - man;
    const int32_t offset = (127 - bias) << 23;
    vec_f32 low = vec_add(mag, vec_set1(inf_adam__bits_f32((uint32_t)(128 - bias) << 23)));
    vec_i32 bits = vec_i32_max(vec_i32_add(vec_as_i32(low), vec_i32_set1(-(1 << 23))),
                               vec_as_i32(mag));
    vec_i32 odd = vec_i32_and(vec_i32_srli(bits, shift), vec_i32_set1(1));
    vec_i32 up = vec_i32_add(vec_i32_add(bits, vec_i32_set1((1 << (shift - 1)) - 1 - offset)),
                             odd);

    return vec_i32_srli(up, shift);
}

/* The magnitude code of each moment x of a block (inf_adam__q8_encode_m or _v without m's sign
 * and v's smallest-code rule), and y = x * inv, or x / scale when inv is 0
 * (inf_adam__q8_inverse). v's y needs no clearing of its sign: v >= +0 (beta2 * v +
 * ((1 - beta2) * g) * g of a v >= +0), and a coded block holds no NaN. m's magnitude codes are
 * at most 0x7f, v's clamp to 0xff is the narrow's. */
INF_ADAM__SIMD_INLINE vec_i32 q8_magnitude_code(vec_f32 x, vec_f32 scale, vec_f32 inv,
                                                int use_inv, int is_m, vec_f32 *y)
{
    *y = use_inv ? vec_mul(x, inv) : vec_div(x, scale);
    if (is_m)
        return q8_encode_magnitude(vec_abs(*y), INF_ADAM__QM_MAN, INF_ADAM__QM_BIAS);
    return q8_encode_magnitude(*y, INF_ADAM__QV_MAN, INF_ADAM__QV_BIAS);
}

/* The whole code of each moment, before the narrow to bytes: m's sign in bit 7; a positive v
 * never codes as 0 (min(bits, 1) is 1 for y > 0, else 0). */
INF_ADAM__SIMD_INLINE vec_i32 q8_code(vec_f32 x, vec_f32 scale, vec_f32 inv, int use_inv,
                                      int is_m)
{
    vec_f32 y;
    vec_i32 code = q8_magnitude_code(x, scale, inv, use_inv, is_m, &y);

    if (is_m)
        return vec_i32_or(code, vec_i32_and(vec_i32_srli(vec_as_i32(y), 24),
                                            vec_i32_set1(0x80)));
    return vec_i32_max(code, vec_i32_min(vec_as_i32(y), vec_i32_set1(1)));
}

/* Code n moments of one block: four vectors at a time (one narrow to bytes for all four, which
 * also sets m's signs and v's smallest codes), then one, then the scalar tail. */
INF_ADAM__SIMD_INLINE void encode(uint8_t *dst, const float *src, size_t n, float scale,
                                  float inv, int use_inv, int is_m)
{
    const size_t w = INF_ADAM__SIMD_WIDTH;
    const vec_f32 s = vec_set1(scale), r = vec_set1(inv);
    size_t k = 0;

    for (; k + 4 * w <= n; k += 4 * w) {
        vec_f32 y[4];
        vec_i32 code[4];

        for (int j = 0; j < 4; j++)
            code[j] = q8_magnitude_code(vec_loadu(src + k + j * w), s, r, use_inv, is_m, &y[j]);
        if (is_m)
            vec_store_u8x4_signs(dst + k, code, y);
        else
            vec_store_u8x4_nonzero(dst + k, code, y);
    }
    for (; k + w <= n; k += w)
        vec_store_u8(dst + k, q8_code(vec_loadu(src + k), s, r, use_inv, is_m));
    for (; k < n; k++)
        dst[k] = is_m ? inf_adam__q8_encode_m(src[k], scale, inv)
                      : inf_adam__q8_encode_v(src[k], scale, inv);
}

INF_ADAM__SIMD_FN void state_encode_m(uint8_t *dst, const float *src, size_t n, float scale,
                                      float inv)
{
    if (inv != 0.0f)
        encode(dst, src, n, scale, inv, 1, 1);
    else
        encode(dst, src, n, scale, inv, 0, 1);
}

INF_ADAM__SIMD_FN void state_encode_v(uint8_t *dst, const float *src, size_t n, float scale,
                                      float inv)
{
    if (inv != 0.0f)
        encode(dst, src, n, scale, inv, 1, 0);
    else
        encode(dst, src, n, scale, inv, 0, 0);
}

INF_ADAM__SIMD_FN void state_convert(float *dst, const void *src, int dtype, size_t n)
{
    size_t k = 0;

    for (; k + INF_ADAM__SIMD_WIDTH <= n; k += INF_ADAM__SIMD_WIDTH)
        vec_storeu(dst + k, load_grad(src, k, dtype));
    for (; k < n; k++)
        dst[k] = inf_adam__load_any(src, dtype, k);
}

/* The 16 random bits of the elements whose counters' low halves are the lanes of lo and
 * whose high halves have the key inf_adam__random_key (inf_adam__random). */
INF_ADAM__SIMD_INLINE vec_i32 random_bits(vec_i32 lo, vec_i32 key)
{
    const vec_i32 mul = vec_i32_set1((int32_t)INF_ADAM__ROUNDING_MUL);

    return vec_i32_srli(vec_i32_mullo(vec_i32_xor(lo, key), mul), 16);
}

/* [Note: stochastic rounding]; `exact`: some lane may be NaN, which rounds as the master's
 * copy does. */
INF_ADAM__SIMD_INLINE vec_u16 sr_bf16(vec_f32 p, vec_i32 r, int exact)
{
    vec_i32 sum = vec_i32_add(vec_as_i32(p), r);

    if (!exact)
        return vec_pack_hi16(sum);
    return vec_pack_u16(vec_i32_select(vec_is_nan(p), vec_bf16_bits(p), vec_i32_srli(sum, 16)));
}

INF_ADAM__SIMD_INLINE vec_u16 sr_f16(vec_f32 p, vec_i32 r)
{
    const vec_f32 low = vec_set1(0x1p-14f);
    vec_f32 a = vec_abs(p);
    vec_mask small = vec_lt(a, low);
    vec_f32 b = vec_select(small, vec_add(a, low), a);
    vec_i32 cut = vec_i32_and(vec_i32_add(vec_as_i32(b), vec_i32_and(r, vec_i32_set1(0x1fff))),
                              vec_i32_set1(~0x1fff));
    vec_f32 t = vec_select(small, vec_sub(vec_as_f32(cut), low), vec_as_f32(cut));
    vec_i32 sign = vec_i32_and(vec_as_i32(p), vec_i32_set1((int32_t)0x80000000u));

    t = vec_as_f32(vec_i32_or(vec_as_i32(t), sign));
    return vec_to_f16(vec_select(vec_not_le(a, vec_set1(FLT_MAX)), p, t));
}

INF_ADAM__SIMD_INLINE vec_f32 load_param(const float *master, const void *values, size_t i,
                                         int has_master, int values_dtype)
{
    return has_master ? vec_loadu(master + i) : st_load_16(values, values_dtype, i);
}

INF_ADAM__SIMD_INLINE void load_moments(const void *exp_avg, const void *exp_avg_sq,
                                         vec_f32 m_scale, vec_f32 v_scale, size_t i, int moments,
                                         vec_f32 *m, vec_f32 *v)
{
    if (moments == INF_ADAM_MOMENTS_F32) {
        *m = vec_loadu((const float *)exp_avg + i);
        *v = vec_loadu((const float *)exp_avg_sq + i);
    } else if (moments == INF_ADAM_MOMENTS_BF16) {
        *m = vec_load_bf16((const uint16_t *)exp_avg + i);
        *v = vec_load_bf16((const uint16_t *)exp_avg_sq + i);
    } else {
        *m = q8_decode_m((const uint8_t *)exp_avg + i, m_scale);
        *v = q8_decode_v((const uint8_t *)exp_avg_sq + i, v_scale);
    }
}

/* The largest |x| so far as float bits (see struct inf_adam__amax). */
INF_ADAM__SIMD_INLINE vec_i32 amax_bits(vec_i32 acc, vec_f32 x)
{
    return vec_i32_max(acc, vec_as_i32(vec_abs(x)));
}

/* Store the new moments: bf16 and float ones in place, 8-bit ones into the block's buffers at
 * k (coded after the block, once its scales are known) with their running maxima; `exact` as
 * st_bf16_bits. */
INF_ADAM__SIMD_INLINE void store_moments(void *exp_avg, void *exp_avg_sq, float *m_buf,
                                         float *v_buf, size_t i, size_t k, int moments,
                                         vec_f32 m, vec_f32 v, vec_i32 *m_max, vec_i32 *v_max,
                                         int exact)
{
    if (moments == INF_ADAM_MOMENTS_F32) {
        vec_storeu((float *)exp_avg + i, m);
        vec_storeu((float *)exp_avg_sq + i, v);
    } else if (moments == INF_ADAM_MOMENTS_BF16) {
        vec_store_u16x2((uint16_t *)exp_avg + i, (uint16_t *)exp_avg_sq + i,
                        st_bf16_bits(m, exact), st_bf16_bits(v, exact));
    } else {
        vec_storeu(m_buf + k, m);
        vec_storeu(v_buf + k, v);
        *m_max = amax_bits(*m_max, m);
        *v_max = amax_bits(*v_max, v);
    }
}

/* Store the new parameter p: to the master and its copy, or stochastically rounded with the
 * random bits r to the values; `exact` as st_bf16_bits. */
INF_ADAM__SIMD_INLINE void store_param(float *params, void *values, size_t i, int master,
                                       int values_dtype, vec_f32 p, vec_i32 r, int exact)
{
    vec_u16 h;

    if (master) {
        vec_storeu(params + i, p);
        if (values_dtype == INF_ADAM_DTYPE_NONE)
            return;
        if (values_dtype == INF_ADAM_DTYPE_F16)
            h = vec_to_f16(p);
        else
            h = exact ? vec_pack_u16(vec_bf16_bits(p)) : vec_pack_hi16(st_bf16_round(p));
    } else {
        h = values_dtype == INF_ADAM_DTYPE_BF16 ? sr_bf16(p, r, exact) : sr_f16(p, r);
    }
    vec_u16_storeu((vec_u16 *)((uint16_t *)values + i), h);
}

/* Ask for the cache lines of an array INF_ADAM__PREFETCH_AHEAD elements of `size` bytes past
 * element i (see inf_adam__prefetch): a prefetch never faults, so running past the end is
 * harmless, and the address is formed as an integer. */
INF_ADAM__SIMD_INLINE void prefetch_ahead(const void *base, size_t i, size_t size)
{
    __builtin_prefetch((const void *)((uintptr_t)base + (i + INF_ADAM__PREFETCH_AHEAD) * size),
                       0, 3);
}

/* The step's float coefficients in every lane, set once per call (not per block). */
struct simd_coef {
    vec_f32 grad_scale;
    vec_f32 weight_decay;
    vec_f32 beta1;
    vec_f32 one_minus_beta1;
    vec_f32 beta2;
    vec_f32 one_minus_beta2;
    vec_f32 decay;
    vec_f32 inv_bc2_sqrt;
    vec_f32 eps;
    vec_f32 step_size;
};

INF_ADAM__SIMD_INLINE struct simd_coef simd_coef_of(const struct inf_adam__state_coef *c)
{
    return (struct simd_coef){vec_set1(c->grad_scale), vec_set1(c->weight_decay),
                              vec_set1(c->beta1), vec_set1(c->one_minus_beta1),
                              vec_set1(c->beta2), vec_set1(c->one_minus_beta2),
                              vec_set1(c->decay), vec_set1(c->inv_bc2_sqrt), vec_set1(c->eps),
                              vec_set1(c->step_size)};
}

/* One pass over a block: per element the new moments, then the parameter from them (see
 * inf_adam__moments_one and inf_adam__param_one, which the tail runs). Every int argument is a
 * constant at its call site: one loop each. Without a master the block's rounding counters
 * must share their high halves (update_block splits the blocks that cross a multiple of 2^32
 * there).
 *
 * [Note: 8-bit update in two passes] Where INF_ADAM__SPLIT_Q8 is 1, 8-bit moments go through
 * the block twice: the new moments into the block's float buffers (which the coding reads
 * anyway), then the parameters from them. The same operations on the same values, so the same
 * bits; but each loop's chain of dependent operations (decode, moments, square root, divide,
 * rounding: some 60 cycles) holds fewer micro-ops in flight, so the core overlaps more
 * iterations. AVX2 on Zen 3 (whose float scheduler is small), one thread, both loops in one
 * process in turns: 0.87-0.89 of the one-pass time for (int8, none), 0.94-0.95 for (int8,
 * fp32) (docs/performance.md). AVX-512 keeps one pass: two gave no gain on Zen 4. The passes
 * repeat the one-pass loop's lines rather than share them through helpers: shared, GCC laid
 * out the (bf16, fp32) loop 9% slower on the same machine. */
INF_ADAM__SIMD_INLINE void update(const struct inf_adam__state_coef *c,
                                  const struct simd_coef *vc, const struct inf_adam_segment *s,
                                  const struct inf_adam__block *b, struct inf_adam__amax *amax,
                                  int moments, int master, int values_dtype, int grad_dtype)
{
    const vec_f32 grad_scale = vc->grad_scale, weight_decay = vc->weight_decay;
    const vec_f32 beta1 = vc->beta1, one_minus_beta1 = vc->one_minus_beta1;
    const vec_f32 beta2 = vc->beta2, one_minus_beta2 = vc->one_minus_beta2;
    const vec_f32 decay = vc->decay, inv_bc2_sqrt = vc->inv_bc2_sqrt, eps = vc->eps;
    const vec_f32 step_size = vc->step_size;
    const size_t msize = moments == INF_ADAM_MOMENTS_F32 ? 4 : moments == INF_ADAM_MOMENTS_BF16
                                                                 ? 2 : 1;
    const size_t lo = b->lo, hi = b->hi;
    /* the arrays and the block's fields in locals, which the stores cannot change (through s
     * and b they could, as far as the compiler knows: it would load them again each
     * iteration) */
    const void *g = b->grad;
    float *params = s->master, *m_buf = b->m, *v_buf = b->v;
    void *values = s->values, *exp_avg = s->exp_avg, *exp_avg_sq = s->exp_avg_sq;
    const vec_f32 m_scale = vec_set1(q8_f16_scale(b->m_scale, INF_ADAM__QM_BIAS));
    const vec_f32 v_scale = vec_set1(q8_f16_scale(b->v_scale, INF_ADAM__QV_BIAS));
    const int l2 = c->l2, decoupled = c->decoupled;
    const vec_i32 key =
        vec_i32_set1((int32_t)inf_adam__random_key(c, (uint32_t)((s->index + lo) >> 32)));
    vec_i32 counter = vec_i32_add(vec_i32_set1((int32_t)(uint32_t)(s->index + lo)), vec_iota());
    vec_i32 m_max = vec_i32_set1(0), v_max = m_max;
    const int rounds_bf16 = moments == INF_ADAM_MOMENTS_BF16 || values_dtype == INF_ADAM_DTYPE_BF16;
    size_t i = lo;

#if INF_ADAM__SPLIT_Q8
    if (moments == INF_ADAM_MOMENTS_Q8) {
        for (size_t j = lo; j + INF_ADAM__SIMD_WIDTH <= hi; j += INF_ADAM__SIMD_WIDTH) {
            vec_f32 grad, m, v;

            prefetch_ahead(g, j - lo, grad_dtype == INF_ADAM_DTYPE_F32 ? 4 : 2);
            prefetch_ahead(exp_avg, j, msize);
            prefetch_ahead(exp_avg_sq, j, msize);
            grad = vec_mul(load_grad(g, j - lo, grad_dtype), grad_scale);
            load_moments(exp_avg, exp_avg_sq, m_scale, v_scale, j, moments, &m, &v);
            if (l2)
                grad = vec_add(grad, vec_mul(weight_decay,
                                             load_param(params, values, j, master, values_dtype)));
            m = vec_add(vec_mul(beta1, m), vec_mul(one_minus_beta1, grad));
            v = vec_add(vec_mul(beta2, v), vec_mul(vec_mul(one_minus_beta2, grad), grad));
            store_moments(exp_avg, exp_avg_sq, m_buf, v_buf, j, j - lo, moments, m, v, &m_max,
                          &v_max, 0);
        }
        for (; i + INF_ADAM__SIMD_WIDTH <= hi; i += INF_ADAM__SIMD_WIDTH) {
            vec_f32 p, d, m = vec_loadu(m_buf + (i - lo)), v = vec_loadu(v_buf + (i - lo));
            vec_i32 r = counter;  /* unused with a master */

            prefetch_ahead(master ? (const void *)params : values, i, master ? 4 : 2);
            p = load_param(params, values, i, master, values_dtype);
            d = vec_add(vec_mul(vec_sqrt(v), inv_bc2_sqrt), eps);
            if (decoupled)
                p = vec_mul(p, decay);
            p = vec_sub(p, vec_div(vec_mul(step_size, m), d));
            if (!master) {
                r = random_bits(counter, key);
                counter = vec_i32_add(counter, vec_i32_set1(INF_ADAM__SIMD_WIDTH));
            }
            /* a NaN moment makes p NaN: one check of p decides the rounding's NaN case */
            if (rounds_bf16 && vec_mask_any(vec_is_nan(p)))
                store_param(params, values, i, master, values_dtype, p, r, 1);
            else
                store_param(params, values, i, master, values_dtype, p, r, 0);
        }
    }
#endif
    for (; i + INF_ADAM__SIMD_WIDTH <= hi; i += INF_ADAM__SIMD_WIDTH) {
        vec_f32 grad, p, m, v, d;
        vec_i32 r;

        prefetch_ahead(g, i - lo, grad_dtype == INF_ADAM_DTYPE_F32 ? 4 : 2);
        prefetch_ahead(master ? (const void *)params : values, i, master ? 4 : 2);
        prefetch_ahead(exp_avg, i, msize);
        prefetch_ahead(exp_avg_sq, i, msize);
        grad = vec_mul(load_grad(g, i - lo, grad_dtype), grad_scale);
        p = load_param(params, values, i, master, values_dtype);
        load_moments(exp_avg, exp_avg_sq, m_scale, v_scale, i, moments, &m, &v);
        if (l2)
            grad = vec_add(grad, vec_mul(weight_decay, p));
        m = vec_add(vec_mul(beta1, m), vec_mul(one_minus_beta1, grad));
        v = vec_add(vec_mul(beta2, v), vec_mul(vec_mul(one_minus_beta2, grad), grad));
        d = vec_add(vec_mul(vec_sqrt(v), inv_bc2_sqrt), eps);
        if (decoupled)
            p = vec_mul(p, decay);
        p = vec_sub(p, vec_div(vec_mul(step_size, m), d));
        r = counter;  /* unused with a master */
        if (!master) {
            r = random_bits(counter, key);
            counter = vec_i32_add(counter, vec_i32_set1(INF_ADAM__SIMD_WIDTH));
        }
        /* a NaN m or v makes p NaN: one check of p decides every bf16 rounding's NaN case */
        if (rounds_bf16 && vec_mask_any(vec_is_nan(p))) {
            store_moments(exp_avg, exp_avg_sq, m_buf, v_buf, i, i - lo, moments, m, v, &m_max,
                          &v_max, 1);
            store_param(params, values, i, master, values_dtype, p, r, 1);
        } else {
            store_moments(exp_avg, exp_avg_sq, m_buf, v_buf, i, i - lo, moments, m, v, &m_max,
                          &v_max, 0);
            store_param(params, values, i, master, values_dtype, p, r, 0);
        }
    }
    if (moments == INF_ADAM_MOMENTS_Q8) {
        amax->m = inf_adam__max_u32(amax->m, (uint32_t)vec_i32_hmax(m_max));
        amax->v = inf_adam__max_u32(amax->v, (uint32_t)vec_i32_hmax(v_max));
    }
    for (; i < hi; i++) {
        inf_adam__moments_one(c, s, b, i, amax);
        inf_adam__param_one(c, s, b, i);
    }
}

/* The pieces of a master-free block that update runs: the block, or if its rounding counters
 * cross a multiple of 2^32 the elements before it and those after; returns how many. A block
 * crosses at most one. */
_Static_assert(INF_ADAM_BLOCK_MAX <= 1 << 16 && INF_ADAM__STATE_UNIT <= 1 << 16,
               "a block's rounding counters cross at most one multiple of 2^32");

INF_ADAM__SIMD_INLINE int split_block(const struct inf_adam_segment *s,
                                      const struct inf_adam__block *b,
                                      struct inf_adam__block *parts)
{
    uint64_t first = s->index + b->lo, last = s->index + b->hi - 1;
    size_t cut;

    parts[0] = *b;
    if (first >> 32 == last >> 32)
        return 1;
    cut = b->lo + (size_t)((last >> 32 << 32) - first);
    parts[0].hi = cut;
    parts[1] = *b;
    parts[1].lo = cut;
    parts[1].grad = (const char *)b->grad + (cut - b->lo) * inf_adam__dtype_size(b->grad_dtype);
    parts[1].m = b->m + (cut - b->lo);
    parts[1].v = b->v + (cut - b->lo);
    return 2;
}

/* update with the block's gradient type as a constant. */
INF_ADAM__SIMD_INLINE void update_typed(const struct inf_adam__state_coef *c,
                                        const struct simd_coef *vc,
                                        const struct inf_adam_segment *s,
                                        const struct inf_adam__block *b,
                                        struct inf_adam__amax *amax, int moments, int master,
                                        int values_dtype)
{
    if (b->grad_dtype == INF_ADAM_DTYPE_BF16)
        update(c, vc, s, b, amax, moments, master, values_dtype, INF_ADAM_DTYPE_BF16);
    else if (b->grad_dtype == INF_ADAM_DTYPE_F16)
        update(c, vc, s, b, amax, moments, master, values_dtype, INF_ADAM_DTYPE_F16);
    else
        update(c, vc, s, b, amax, moments, master, values_dtype, INF_ADAM_DTYPE_F32);
}

/* update_typed on the block (master-free: on each piece of split_block), or the scalar loop
 * for an 8-bit block whose scales q8_f16_scale cannot take (m beyond FLT_MAX / 2^8, 1.3e36: v
 * is then inf). */
INF_ADAM__SIMD_INLINE void update_block(const struct inf_adam__state_coef *c,
                                        const struct simd_coef *vc,
                                        const struct inf_adam_segment *s,
                                        const struct inf_adam__block *b,
                                        struct inf_adam__amax *amax, int moments, int master,
                                        int values_dtype)
{
    struct inf_adam__block parts[2];
    int n;

    if (moments == INF_ADAM_MOMENTS_Q8 && !(q8_f16_scale_fits(b->m_scale, INF_ADAM__QM_BIAS) &&
                                            q8_f16_scale_fits(b->v_scale, INF_ADAM__QV_BIAS))) {
        inf_adam__state_scalar.update(c, s, b, 1, amax);
        return;
    }
    if (master) {
        update_typed(c, vc, s, b, amax, moments, master, values_dtype);
        return;
    }
    n = split_block(s, b, parts);
    for (int k = 0; k < n; k++)
        update_typed(c, vc, s, &parts[k], amax, moments, master, values_dtype);
}

/* The blocks of one call in one loop of the format's case: the coefficients are set once. */
#define INF_ADAM__STATE_CASE(mo, ma, vd)                                                    \
    case ((mo) * 2 + (ma)) * 4 + (vd):                                                      \
        for (size_t k = 0; k < n; k++)                                                      \
            update_block(c, &vc, s, &b[k], &amax[k], (mo), (ma), (vd));                     \
        break

INF_ADAM__SIMD_FN void state_update(const struct inf_adam__state_coef *c,
                                    const struct inf_adam_segment *s,
                                    const struct inf_adam__block *b, size_t n,
                                    struct inf_adam__amax *amax)
{
    const struct simd_coef vc = simd_coef_of(c);

    switch ((s->moments * 2 + (s->master != NULL)) * 4 + s->values_dtype) {
    INF_ADAM__STATE_CASE(INF_ADAM_MOMENTS_F32, 0, INF_ADAM_DTYPE_BF16);
    INF_ADAM__STATE_CASE(INF_ADAM_MOMENTS_F32, 0, INF_ADAM_DTYPE_F16);
    INF_ADAM__STATE_CASE(INF_ADAM_MOMENTS_BF16, 0, INF_ADAM_DTYPE_BF16);
    INF_ADAM__STATE_CASE(INF_ADAM_MOMENTS_BF16, 0, INF_ADAM_DTYPE_F16);
    INF_ADAM__STATE_CASE(INF_ADAM_MOMENTS_BF16, 1, INF_ADAM_DTYPE_NONE);
    INF_ADAM__STATE_CASE(INF_ADAM_MOMENTS_BF16, 1, INF_ADAM_DTYPE_BF16);
    INF_ADAM__STATE_CASE(INF_ADAM_MOMENTS_BF16, 1, INF_ADAM_DTYPE_F16);
    INF_ADAM__STATE_CASE(INF_ADAM_MOMENTS_Q8, 0, INF_ADAM_DTYPE_BF16);
    INF_ADAM__STATE_CASE(INF_ADAM_MOMENTS_Q8, 0, INF_ADAM_DTYPE_F16);
    INF_ADAM__STATE_CASE(INF_ADAM_MOMENTS_Q8, 1, INF_ADAM_DTYPE_NONE);
    INF_ADAM__STATE_CASE(INF_ADAM_MOMENTS_Q8, 1, INF_ADAM_DTYPE_BF16);
    INF_ADAM__STATE_CASE(INF_ADAM_MOMENTS_Q8, 1, INF_ADAM_DTYPE_F16);
    default:
        /* adam_state.c validated the segment; keep the scalar meaning for anything else */
        inf_adam__state_scalar.update(c, s, b, n, amax);
    }
}

#undef INF_ADAM__STATE_CASE
