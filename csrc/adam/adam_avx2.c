/*
 * AVX2 + FMA + F16C inner loop of inf_adam: 8 elements per iteration, unaligned loads and
 * stores, the tail through the scalar update. Compiled for any x86-64 and only called when the
 * CPU has all three (checked in adam.c); see [Note: one formula] in adam_kernel.h.
 */
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include "adam_kernel.h"

#define INF_ADAM__AVX2 __attribute__((target("avx2,fma,f16c")))
#define INF_ADAM__AVX2_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

INF_ADAM__AVX2_INLINE __m256 load_grad(const void *grad, size_t i, int dtype)
{
    if (dtype == INF_ADAM_DTYPE_BF16) {
        __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)grad + i));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    }
    if (dtype == INF_ADAM_DTYPE_F16)
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)grad + i)));
    return _mm256_loadu_ps((const float *)grad + i);
}

/* See [Note: lowp rounding] in inf_adam.h. */
INF_ADAM__AVX2_INLINE __m128i to_bf16(__m256 p)
{
    __m256i u = _mm256_castps_si256(p);
    __m256i top = _mm256_srli_epi32(u, 16);
    __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                    _mm256_and_si256(top, _mm256_set1_epi32(1)));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    __m256i quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    __m256i r = _mm256_blendv_epi8(rounded, quiet, nan);
    /* every lane is <= 0xffff, so the unsigned-saturating pack only narrows */
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* Non-temporal when asked and aligned: the copy is not read again soon, so it should not
 * evict the state arrays from cache or cost a read-for-ownership of each line. */
INF_ADAM__AVX2_INLINE void store_out(void *out, size_t i, __m256 p, int dtype, int stream)
{
    __m128i h, *dst;

    if (dtype == INF_ADAM_DTYPE_BF16)
        h = to_bf16(p);
    else if (dtype == INF_ADAM_DTYPE_F16)
        h = _mm256_cvtps_ph(p, _MM_FROUND_TO_NEAREST_INT);
    else
        return;
    dst = (__m128i *)((uint16_t *)out + i);
    if (stream && ((uintptr_t)dst & 15) == 0)
        _mm_stream_si128(dst, h);
    else
        _mm_storeu_si128(dst, h);
}

/* grad_dtype and out_dtype are constants at each call site, so each gets its own loop. */
INF_ADAM__AVX2_INLINE void run(const struct inf_adam__coef *c, const struct inf_adam__arrays *a,
                               size_t lo, size_t hi, int grad_dtype, int out_dtype)
{
    const __m256 grad_scale = _mm256_set1_ps(c->grad_scale);
    const __m256 weight_decay = _mm256_set1_ps(c->weight_decay);
    const __m256 decay = _mm256_set1_ps(c->decay);
    const __m256 lerp_w = _mm256_set1_ps(c->lerp_w);
    const __m256 beta2 = _mm256_set1_ps(c->beta2);
    const __m256 one_minus_beta2 = _mm256_set1_ps(c->one_minus_beta2);
    const __m256 bc2_sqrt = _mm256_set1_ps(c->bc2_sqrt);
    const __m256 eps = _mm256_set1_ps(c->eps);
    const __m256 step_size = _mm256_set1_ps(c->step_size);
    size_t i = lo;

    for (; i + 8 <= hi; i += 8) {
        inf_adam__prefetch(a, i);
        __m256 g = _mm256_mul_ps(load_grad(a->grad, i, grad_dtype), grad_scale);
        __m256 p = _mm256_loadu_ps(a->param + i);
        __m256 m = _mm256_loadu_ps(a->exp_avg + i);
        __m256 v = _mm256_loadu_ps(a->exp_avg_sq + i);
        __m256 d;

        if (c->l2)
            g = _mm256_fmadd_ps(p, weight_decay, g);
        if (c->decoupled)
            p = _mm256_mul_ps(p, decay);
        m = _mm256_fmadd_ps(lerp_w, _mm256_sub_ps(g, m), c->lerp_big ? g : m);
        v = _mm256_fmadd_ps(_mm256_mul_ps(one_minus_beta2, g), g, _mm256_mul_ps(v, beta2));
        d = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(v), bc2_sqrt), eps);
        p = _mm256_sub_ps(p, _mm256_div_ps(_mm256_mul_ps(step_size, m), d));

        _mm256_storeu_ps(a->param + i, p);
        _mm256_storeu_ps(a->exp_avg + i, m);
        _mm256_storeu_ps(a->exp_avg_sq + i, v);
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

INF_ADAM__AVX2 void inf_adam__range_avx2(const struct inf_adam__coef *c,
                                         const struct inf_adam__arrays *a, size_t lo, size_t hi)
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
