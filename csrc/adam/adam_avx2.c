/*
 * AVX2 + FMA + F16C inner loop of inf_adam, 8 elements per iteration: the vector type and its
 * operations for the loop in adam_simd_body.h. Compiled for any x86-64 and only called when the
 * CPU has all three (checked in adam.c).
 */
#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#include "adam_kernel.h"

#define INF_ADAM__AVX2 __attribute__((target("avx2,fma,f16c")))
#define INF_ADAM__SIMD_INLINE static inline __attribute__((always_inline, target("avx2,fma,f16c")))

typedef __m256 vec_f32;
typedef __m128i vec_u16;

#define vec_set1(x) _mm256_set1_ps(x)
#define vec_loadu(src) _mm256_loadu_ps(src)
#define vec_storeu(dst, x) _mm256_storeu_ps(dst, x)
#define vec_add(x, y) _mm256_add_ps(x, y)
#define vec_sub(x, y) _mm256_sub_ps(x, y)
#define vec_mul(x, y) _mm256_mul_ps(x, y)
#define vec_div(x, y) _mm256_div_ps(x, y)
#define vec_sqrt(x) _mm256_sqrt_ps(x)
#define vec_fmadd(x, y, z) _mm256_fmadd_ps(x, y, z)
#define vec_load_f16(src) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(src)))
#define vec_to_f16(x) _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)
#define vec_u16_storeu(dst, h) _mm_storeu_si128(dst, h)
#define vec_u16_stream(dst, h) _mm_stream_si128(dst, h)

INF_ADAM__SIMD_INLINE vec_f32 vec_load_bf16(const uint16_t *src)
{
    __m128i h = _mm_loadu_si128((const __m128i *)src);

    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

/* See [Note: lowp rounding] in inf_adam.h. */
INF_ADAM__SIMD_INLINE vec_u16 vec_to_bf16(vec_f32 p)
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

#include "adam_simd_body.h"

INF_ADAM__AVX2 void inf_adam__range_avx2(const struct inf_adam__coef *c,
                                         const struct inf_adam__arrays *a, size_t lo, size_t hi)
{
    simd_range(c, a, lo, hi);
}

#endif /* x86 */
