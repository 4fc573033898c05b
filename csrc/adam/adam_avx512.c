/*
 * AVX-512 F inner loop of inf_adam, 16 elements per iteration: the vector type and its
 * operations for the loop in adam_simd_body.h. Compiled for any x86-64 and only called when the
 * CPU has AVX-512 F (checked in adam.c).
 */
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include "adam_kernel.h"

#define INF_ADAM__AVX512 __attribute__((target("avx512f")))
#define INF_ADAM__SIMD_INLINE static inline __attribute__((always_inline, target("avx512f")))

typedef __m512 vec_f32;
typedef __m256i vec_u16;

#define vec_set1(x) _mm512_set1_ps(x)
#define vec_loadu(src) _mm512_loadu_ps(src)
#define vec_storeu(dst, x) _mm512_storeu_ps(dst, x)
#define vec_add(x, y) _mm512_add_ps(x, y)
#define vec_sub(x, y) _mm512_sub_ps(x, y)
#define vec_mul(x, y) _mm512_mul_ps(x, y)
#define vec_div(x, y) _mm512_div_ps(x, y)
#define vec_sqrt(x) _mm512_sqrt_ps(x)
#define vec_fmadd(x, y, z) _mm512_fmadd_ps(x, y, z)
#define vec_load_f16(src) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(src)))
#define vec_to_f16(x) _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)
#define vec_u16_storeu(dst, h) _mm256_storeu_si256(dst, h)
#define vec_u16_stream(dst, h) _mm256_stream_si256(dst, h)

INF_ADAM__SIMD_INLINE vec_f32 vec_load_bf16(const uint16_t *src)
{
    __m256i h = _mm256_loadu_si256((const __m256i *)src);

    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* See [Note: lowp rounding] in inf_adam.h. */
INF_ADAM__SIMD_INLINE vec_u16 vec_to_bf16(vec_f32 p)
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

#include "adam_simd_body.h"

INF_ADAM__AVX512 void inf_adam__range_avx512(const struct inf_adam__coef *c,
                                             const struct inf_adam__arrays *a, size_t lo,
                                             size_t hi)
{
    simd_range(c, a, lo, hi);
}

#endif /* x86 */
