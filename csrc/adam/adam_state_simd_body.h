/*
 * The SIMD loops of inf_adam_state_step, written once for every vector width; see
 * adam_state_kernel.h for the formula and its notes. Included once by each ISA adapter
 * (adam_avx2.c, adam_avx512.c) after adam_simd_body.h, which brings the float operations; the
 * adapter also defines
 *
 *   vec_i32                   a vector of as many 32-bit integers as vec_f32 has floats
 *   vec_mask                  the result of a comparison, one flag per lane
 *   vec_max, vec_abs          float max (of non-NaN values) and |x|
 *   vec_as_i32, vec_as_f32    the same bits as the other type
 *   vec_i32_set1, _add, _and, _or, _xor, _mullo (low 32 bits), _min, _max (signed),
 *   vec_i32_srli, _slli       shift each lane by a constant (logical)
 *   vec_iota                  0, 1, 2, ... one per lane
 *   vec_lt, vec_gt            ordered float comparisons
 *   vec_not_le(x, y)          !(x <= y): true for a NaN lane
 *   vec_is_nan(x)
 *   vec_u32_lt                unsigned integer comparison
 *   vec_mask_or, vec_mask_any
 *   vec_select, vec_i32_select (mask, where true, where false)
 *   vec_load_u8, vec_store_u8 as many bytes as lanes, widened / narrowed (values <= 255)
 *   vec_bf16_bits             32-bit lanes of the bf16 rounding of [Note: lowp rounding]
 *   vec_pack_u16              narrow 32-bit lanes (values <= 0xffff) to a vec_u16
 *   vec_hmax                  the largest lane (of non-NaN lanes)
 *   INF_ADAM__SIMD_FN         `static` with the ISA's target attribute
 *
 * and gets the static state_convert, state_update, state_encode_m and state_encode_v that its
 * exported table inf_adam__state_<isa> points to.
 */
#ifndef INF_ADAM__SIMD_WIDTH
#error "adam_state_simd_body.h is included after adam_simd_body.h by an ISA adapter"
#endif

#include "adam_state_kernel.h"

INF_ADAM__SIMD_INLINE vec_f32 st_load_16(const void *src, int dtype, size_t i)
{
    if (dtype == INF_ADAM_DTYPE_BF16)
        return vec_load_bf16((const uint16_t *)src + i);
    return vec_load_f16((const uint16_t *)src + i);
}

INF_ADAM__SIMD_INLINE void st_store_16(void *dst, size_t i, vec_f32 x, int dtype)
{
    vec_u16 h = dtype == INF_ADAM_DTYPE_BF16 ? vec_to_bf16(x) : vec_to_f16(x);

    vec_u16_storeu((vec_u16 *)((uint16_t *)dst + i), h);
}

/* Value of each 8-bit magnitude code; see inf_adam__q8_magnitude. */
INF_ADAM__SIMD_INLINE vec_f32 q8_magnitude(vec_i32 mag, int man, int bias)
{
    return vec_mul(vec_as_f32(vec_i32_slli(mag, 23 - man)),
                   vec_set1(inf_adam__bits_f32((uint32_t)(127 + 127 - bias) << 23)));
}

INF_ADAM__SIMD_INLINE vec_f32 q8_decode_m(const uint8_t *src, vec_f32 scale)
{
    vec_i32 code = vec_load_u8(src);
    vec_f32 mag = q8_magnitude(vec_i32_and(code, vec_i32_set1(0x7f)), INF_ADAM__QM_MAN,
                               INF_ADAM__QM_BIAS);
    vec_i32 sign = vec_i32_slli(vec_i32_and(code, vec_i32_set1(0x80)), 24);

    return vec_mul(vec_as_f32(vec_i32_or(vec_as_i32(mag), sign)), scale);
}

INF_ADAM__SIMD_INLINE vec_f32 q8_decode_v(const uint8_t *src, vec_f32 scale)
{
    return vec_mul(q8_magnitude(vec_load_u8(src), INF_ADAM__QV_MAN, INF_ADAM__QV_BIAS), scale);
}

/* See inf_adam__q8_encode_magnitude. */
INF_ADAM__SIMD_INLINE vec_i32 q8_encode_magnitude(vec_f32 mag, int man, int bias, int max_code)
{
    const int shift = 23 - man;
    vec_i32 bits = vec_as_i32(vec_mul(mag, vec_set1(inf_adam__bits_f32((uint32_t)bias << 23))));
    vec_i32 odd = vec_i32_and(vec_i32_srli(bits, shift), vec_i32_set1(1));
    vec_i32 up = vec_i32_add(vec_i32_add(bits, vec_i32_set1((1 << (shift - 1)) - 1)), odd);

    return vec_i32_min(vec_i32_srli(up, shift), vec_i32_set1(max_code));
}

/* y = x * inv, or x / scale when inv is 0 (inf_adam__q8_inverse): inv is one per block. */
INF_ADAM__SIMD_INLINE vec_f32 q8_normalize(vec_f32 x, vec_f32 scale, vec_f32 inv, int use_inv)
{
    return use_inv ? vec_mul(x, inv) : vec_div(x, scale);
}

INF_ADAM__SIMD_INLINE void encode_m(uint8_t *dst, const float *src, size_t n, float scale,
                                    float inv, int use_inv)
{
    const vec_f32 s = vec_set1(scale), r = vec_set1(inv);
    size_t k = 0;

    for (; k + INF_ADAM__SIMD_WIDTH <= n; k += INF_ADAM__SIMD_WIDTH) {
        vec_f32 y = q8_normalize(vec_loadu(src + k), s, r, use_inv);
        vec_i32 code = q8_encode_magnitude(vec_abs(y), INF_ADAM__QM_MAN, INF_ADAM__QM_BIAS, 0x7f);
        vec_i32 sign = vec_i32_and(vec_i32_srli(vec_as_i32(y), 24), vec_i32_set1(0x80));

        vec_store_u8(dst + k, vec_i32_or(code, sign));
    }
    for (; k < n; k++)
        dst[k] = inf_adam__q8_encode_m(src[k], scale, inv);
}

INF_ADAM__SIMD_INLINE void encode_v(uint8_t *dst, const float *src, size_t n, float scale,
                                    float inv, int use_inv)
{
    const vec_f32 s = vec_set1(scale), r = vec_set1(inv), zero = vec_set1(0.0f);
    const vec_i32 one = vec_i32_set1(1), none = vec_i32_set1(0);
    size_t k = 0;

    for (; k + INF_ADAM__SIMD_WIDTH <= n; k += INF_ADAM__SIMD_WIDTH) {
        vec_f32 mag = vec_abs(q8_normalize(vec_loadu(src + k), s, r, use_inv));
        vec_i32 code = q8_encode_magnitude(mag, INF_ADAM__QV_MAN, INF_ADAM__QV_BIAS, 0xff);

        /* a positive value never codes as 0 */
        code = vec_i32_max(code, vec_i32_select(vec_gt(mag, zero), one, none));
        vec_store_u8(dst + k, code);
    }
    for (; k < n; k++)
        dst[k] = inf_adam__q8_encode_v(src[k], scale, inv);
}

INF_ADAM__SIMD_FN void state_encode_m(uint8_t *dst, const float *src, size_t n, float scale,
                                      float inv)
{
    if (inv != 0.0f)
        encode_m(dst, src, n, scale, inv, 1);
    else
        encode_m(dst, src, n, scale, inv, 0);
}

INF_ADAM__SIMD_FN void state_encode_v(uint8_t *dst, const float *src, size_t n, float scale,
                                      float inv)
{
    if (inv != 0.0f)
        encode_v(dst, src, n, scale, inv, 1);
    else
        encode_v(dst, src, n, scale, inv, 0);
}

INF_ADAM__SIMD_FN void state_convert(float *dst, const void *src, int dtype, size_t n)
{
    size_t k = 0;

    for (; k + INF_ADAM__SIMD_WIDTH <= n; k += INF_ADAM__SIMD_WIDTH)
        vec_storeu(dst + k, load_grad(src, k, dtype));
    for (; k < n; k++)
        dst[k] = inf_adam__load_any(src, dtype, k);
}

INF_ADAM__SIMD_INLINE vec_i32 mix32(vec_i32 x)
{
    x = vec_i32_xor(x, vec_i32_srli(x, 16));
    x = vec_i32_mullo(x, vec_i32_set1(0x7feb352d));
    x = vec_i32_xor(x, vec_i32_srli(x, 15));
    x = vec_i32_mullo(x, vec_i32_set1((int32_t)0x846ca68bu));
    return vec_i32_xor(x, vec_i32_srli(x, 16));
}

/* The random bits of element counters j, j + 1, ... (see inf_adam__random); `key` is
 * inf_adam__random_key of their high half when they all share it (block_key), else 0. */
INF_ADAM__SIMD_INLINE vec_i32 random_bits(const struct inf_adam__state_coef *c, uint64_t j,
                                          vec_i32 key, int block_key)
{
    vec_i32 lane = vec_iota();
    vec_i32 lo = vec_i32_add(vec_i32_set1((int32_t)(uint32_t)j), lane);

    if (!block_key) {  /* a lane whose low half wrapped past 2^32 carries one into its high half */
        vec_i32 carry = vec_i32_select(vec_u32_lt(lo, lane), vec_i32_set1(1), vec_i32_set1(0));
        vec_i32 hi = vec_i32_add(vec_i32_set1((int32_t)(uint32_t)(j >> 32)), carry);

        key = vec_i32_xor(vec_i32_set1((int32_t)c->key0),
                          mix32(vec_i32_xor(hi, vec_i32_set1((int32_t)c->key1))));
    }
    return mix32(vec_i32_xor(lo, key));
}

/* [Note: stochastic rounding] */
INF_ADAM__SIMD_INLINE vec_u16 sr_bf16(vec_f32 p, vec_i32 r)
{
    vec_i32 bits = vec_i32_srli(vec_i32_add(vec_as_i32(p), vec_i32_and(r, vec_i32_set1(0xffff))),
                                16);
    vec_mask nan = vec_is_nan(p);

    if (vec_mask_any(nan))  /* rare: NaN rounds as the master's copy does */
        bits = vec_i32_select(nan, vec_bf16_bits(p), bits);
    return vec_pack_u16(bits);
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

/* Pass 1 over a block (see inf_adam__moments_one). moments, master and values_dtype are
 * constants at each call site: one loop each. */
INF_ADAM__SIMD_INLINE void moments_pass(const struct inf_adam__state_coef *c,
                                        const struct inf_adam_segment *s,
                                        const struct inf_adam__block *b,
                                        struct inf_adam__amax *amax, int moments, int master,
                                        int values_dtype)
{
    const vec_f32 grad_scale = vec_set1(c->grad_scale);
    const vec_f32 weight_decay = vec_set1(c->weight_decay);
    const vec_f32 beta1 = vec_set1(c->beta1), one_minus_beta1 = vec_set1(c->one_minus_beta1);
    const vec_f32 beta2 = vec_set1(c->beta2), one_minus_beta2 = vec_set1(c->one_minus_beta2);
    const vec_f32 m_scale = vec_set1(b->m_scale), v_scale = vec_set1(b->v_scale);
    const vec_f32 fmax = vec_set1(FLT_MAX);
    const float *params = s->master;
    const void *g = b->grad;
    const int grad_dtype = b->grad_dtype;
    const void *values = s->values;
    void *exp_avg = s->exp_avg, *exp_avg_sq = s->exp_avg_sq;
    float *new_m = b->m, *new_v = b->v;
    const size_t lo = b->lo;
    const int l2 = c->l2;
    vec_f32 m_max = vec_set1(0.0f), v_max = vec_set1(0.0f);
    vec_mask m_bad = vec_not_le(m_max, fmax), v_bad = m_bad;  /* all false */
    size_t i = b->lo;

    for (; i + INF_ADAM__SIMD_WIDTH <= b->hi; i += INF_ADAM__SIMD_WIDTH) {
        vec_f32 grad = vec_mul(load_grad(g, i - lo, grad_dtype), grad_scale);
        vec_f32 m, v;

        if (moments == INF_ADAM_MOMENTS_F32) {
            m = vec_loadu((const float *)exp_avg + i);
            v = vec_loadu((const float *)exp_avg_sq + i);
        } else if (moments == INF_ADAM_MOMENTS_BF16) {
            m = vec_load_bf16((const uint16_t *)exp_avg + i);
            v = vec_load_bf16((const uint16_t *)exp_avg_sq + i);
        } else {
            m = q8_decode_m((const uint8_t *)exp_avg + i, m_scale);
            v = q8_decode_v((const uint8_t *)exp_avg_sq + i, v_scale);
        }
        if (l2)
            grad = vec_add(grad, vec_mul(weight_decay,
                                         load_param(params, values, i, master, values_dtype)));
        m = vec_add(vec_mul(beta1, m), vec_mul(one_minus_beta1, grad));
        v = vec_add(vec_mul(beta2, v), vec_mul(vec_mul(one_minus_beta2, grad), grad));
        vec_storeu(new_m + (i - lo), m);
        vec_storeu(new_v + (i - lo), v);

        if (moments == INF_ADAM_MOMENTS_F32) {
            vec_storeu((float *)exp_avg + i, m);
            vec_storeu((float *)exp_avg_sq + i, v);
        } else if (moments == INF_ADAM_MOMENTS_BF16) {
            st_store_16(exp_avg, i, m, INF_ADAM_DTYPE_BF16);
            st_store_16(exp_avg_sq, i, v, INF_ADAM_DTYPE_BF16);
        } else {
            vec_f32 am = vec_abs(m), av = vec_abs(v);

            m_max = vec_max(m_max, am);
            v_max = vec_max(v_max, av);
            m_bad = vec_mask_or(m_bad, vec_not_le(am, fmax));
            v_bad = vec_mask_or(v_bad, vec_not_le(av, fmax));
        }
    }
    if (moments == INF_ADAM_MOMENTS_Q8) {
        /* NaN lanes may or may not win a max; the bad flags make such a block NaN anyway */
        amax->m = fmaxf(amax->m, vec_hmax(m_max));
        amax->v = fmaxf(amax->v, vec_hmax(v_max));
        amax->m_bad |= vec_mask_any(m_bad);
        amax->v_bad |= vec_mask_any(v_bad);
    }
    for (; i < b->hi; i++)
        inf_adam__moments_one(c, s, b, i, amax);
}

/* Pass 2 over a block (see inf_adam__param_one). */
INF_ADAM__SIMD_INLINE void param_pass(const struct inf_adam__state_coef *c,
                                      const struct inf_adam_segment *s,
                                      const struct inf_adam__block *b, int master,
                                      int values_dtype)
{
    const vec_f32 decay = vec_set1(c->decay);
    const vec_f32 inv_bc2_sqrt = vec_set1(c->inv_bc2_sqrt);
    const vec_f32 eps = vec_set1(c->eps);
    const vec_f32 step_size = vec_set1(c->step_size);
    const float *new_m = b->m, *new_v = b->v;
    const size_t lo = b->lo;
    float *params = s->master;
    void *values = s->values;
    const uint64_t index = s->index;
    const int decoupled = c->decoupled;
    /* the block's counters share their high half unless it crosses a multiple of 2^32 */
    const int block_key = (index + lo) >> 32 == (index + b->hi - 1) >> 32;
    const uint32_t hi_half = (uint32_t)((index + lo) >> 32);
    const vec_i32 key = vec_i32_set1((int32_t)inf_adam__random_key(c, hi_half));
    size_t i = b->lo;

    for (; i + INF_ADAM__SIMD_WIDTH <= b->hi; i += INF_ADAM__SIMD_WIDTH) {
        vec_f32 p = load_param(params, values, i, master, values_dtype);
        vec_f32 d = vec_add(vec_mul(vec_sqrt(vec_loadu(new_v + (i - lo))), inv_bc2_sqrt), eps);

        if (decoupled)
            p = vec_mul(p, decay);
        p = vec_sub(p, vec_div(vec_mul(step_size, vec_loadu(new_m + (i - lo))), d));
        if (master) {
            vec_storeu(params + i, p);
            if (values_dtype != INF_ADAM_DTYPE_NONE)
                st_store_16(values, i, p, values_dtype);
        } else {
            vec_i32 r = random_bits(c, index + i, key, block_key);
            vec_u16 h = values_dtype == INF_ADAM_DTYPE_BF16 ? sr_bf16(p, r) : sr_f16(p, r);

            vec_u16_storeu((vec_u16 *)((uint16_t *)values + i), h);
        }
    }
    for (; i < b->hi; i++)
        inf_adam__param_one(c, s, b, i);
}

INF_ADAM__SIMD_INLINE void update(const struct inf_adam__state_coef *c,
                                  const struct inf_adam_segment *s,
                                  const struct inf_adam__block *b, struct inf_adam__amax *amax,
                                  int moments, int master, int values_dtype)
{
    moments_pass(c, s, b, amax, moments, master, values_dtype);
    param_pass(c, s, b, master, values_dtype);
}

#define INF_ADAM__STATE_CASE(mo, ma, vd)                                                    \
    case ((mo) * 2 + (ma)) * 4 + (vd):                                                      \
        update(c, s, b, amax, (mo), (ma), (vd));                                            \
        break

INF_ADAM__SIMD_FN void state_update(const struct inf_adam__state_coef *c,
                                    const struct inf_adam_segment *s,
                                    const struct inf_adam__block *b, struct inf_adam__amax *amax)
{
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
        inf_adam__state_scalar.update(c, s, b, amax);
    }
}

#undef INF_ADAM__STATE_CASE
