/*
 * AVX-512 F inner loop of inf_adam: 16 elements per iteration, unaligned loads and stores, the
 * tail through the scalar update. Compiled for any x86-64 and only called when the CPU has
 * AVX-512 F (checked in adam.c); see [Note: one formula] in adam_kernel.h.
 */
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include "adam_kernel.h"

#define INF_ADAM__AVX512 __attribute__((target("avx512f")))
#define INF_ADAM__AVX512_INLINE static inline __attribute__((always_inline, target("avx512f")))

INF_ADAM__AVX512_INLINE __m512 load_grad(const void *grad, size_t i, int dtype)
{
    if (dtype == INF_ADAM_DTYPE_BF16) {
        __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)grad + i));
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    }
    if (dtype == INF_ADAM_DTYPE_F16)
        return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)grad + i)));
    return _mm512_loadu_ps((const float *)grad + i);
}

/* See [Note: lowp rounding] in inf_adam.h. */
INF_ADAM__AVX512_INLINE __m256i to_bf16(__m512 p)
{
    __m512i u = _mm512_castps_si512(p);
    __m512i top = _mm512_srli_epi32(u, 16);
    __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                    _mm512_and_si512(top, _mm512_set1_epi32(1)));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    __m512i quiet = _mm512_or_si512(top, _mm512_set1_epi32(0x40));
    __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(nan, rounded, quiet));
}

/* Non-temporal when asked and aligned: the copy is not read again soon, so it should not
 * evict the state arrays from cache or cost a read-for-ownership of each line. */
INF_ADAM__AVX512_INLINE void store_out(void *out, size_t i, __m512 p, int dtype, int stream)
{
    __m256i h, *dst;

    if (dtype == INF_ADAM_DTYPE_BF16)
        h = to_bf16(p);
    else if (dtype == INF_ADAM_DTYPE_F16)
        h = _mm512_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
    else
        return;
    dst = (__m256i *)((uint16_t *)out + i);
    if (stream && ((uintptr_t)dst & 31) == 0)
        _mm256_stream_si256(dst, h);
    else
        _mm256_storeu_si256(dst, h);
}

/* grad_dtype and out_dtype are constants at each call site, so each gets its own loop. */
INF_ADAM__AVX512_INLINE void run(const struct inf_adam__coef *c, const struct inf_adam__arrays *a,
                                 size_t lo, size_t hi, int grad_dtype, int out_dtype)
{
    const __m512 grad_scale = _mm512_set1_ps(c->grad_scale);
    const __m512 weight_decay = _mm512_set1_ps(c->weight_decay);
    const __m512 decay = _mm512_set1_ps(c->decay);
    const __m512 lerp_w = _mm512_set1_ps(c->lerp_w);
    const __m512 beta2 = _mm512_set1_ps(c->beta2);
    const __m512 one_minus_beta2 = _mm512_set1_ps(c->one_minus_beta2);
    const __m512 bc2_sqrt = _mm512_set1_ps(c->bc2_sqrt);
    const __m512 eps = _mm512_set1_ps(c->eps);
    const __m512 step_size = _mm512_set1_ps(c->step_size);
    size_t i = lo;

    for (; i + 16 <= hi; i += 16) {
        inf_adam__prefetch(a, i);
        __m512 g = _mm512_mul_ps(load_grad(a->grad, i, grad_dtype), grad_scale);
        __m512 p = _mm512_loadu_ps(a->param + i);
        __m512 m = _mm512_loadu_ps(a->exp_avg + i);
        __m512 v = _mm512_loadu_ps(a->exp_avg_sq + i);
        __m512 d;

        if (c->l2)
            g = _mm512_fmadd_ps(p, weight_decay, g);
        if (c->decoupled)
            p = _mm512_mul_ps(p, decay);
        m = _mm512_fmadd_ps(lerp_w, _mm512_sub_ps(g, m), c->lerp_big ? g : m);
        v = _mm512_fmadd_ps(_mm512_mul_ps(one_minus_beta2, g), g, _mm512_mul_ps(v, beta2));
        d = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(v), bc2_sqrt), eps);
        p = _mm512_sub_ps(p, _mm512_div_ps(_mm512_mul_ps(step_size, m), d));

        _mm512_storeu_ps(a->param + i, p);
        _mm512_storeu_ps(a->exp_avg + i, m);
        _mm512_storeu_ps(a->exp_avg_sq + i, v);
        store_out(a->out, i, p, out_dtype, a->stream_out);
    }
    for (; i < hi; i++)
        inf_adam__update_one(c, a, i);
    if (a->stream_out)
        _mm_sfence();  /* order the non-temporal stores before the caller sees "done" */
}

#define INF_ADAM__CASE(gd, od)                                                              \
    case (gd) * 4 + (od):                                                                   \
        run(c, a, lo, hi, (gd), (od));                                                      \
        break

INF_ADAM__AVX512 void inf_adam__range_avx512(const struct inf_adam__coef *c,
                                             const struct inf_adam__arrays *a, size_t lo,
                                             size_t hi)
{
    switch (a->grad_dtype * 4 + a->out_dtype) {
    INF_ADAM__CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_NONE);
    INF_ADAM__CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_BF16);
    INF_ADAM__CASE(INF_ADAM_DTYPE_F32, INF_ADAM_DTYPE_F16);
    INF_ADAM__CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_NONE);
    INF_ADAM__CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_BF16);
    INF_ADAM__CASE(INF_ADAM_DTYPE_BF16, INF_ADAM_DTYPE_F16);
    INF_ADAM__CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_NONE);
    INF_ADAM__CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_BF16);
    INF_ADAM__CASE(INF_ADAM_DTYPE_F16, INF_ADAM_DTYPE_F16);
    default:
        /* adam.c validated the types; keep the scalar meaning for anything else */
        inf_adam__range_scalar(c, a, lo, hi);
    }
}

#endif /* x86 */
