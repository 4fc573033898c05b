/*
 * AVX-512 F inner loops of inf_adam, 16 elements per iteration: the vector types and their
 * operations for the loops in adam_simd_body.h and adam_state_simd_body.h. Compiled for any
 * x86-64 and only called when the CPU has AVX-512 F (checked in adam.c).
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
#define vec_from_f16(h) _mm512_cvtph_ps(h)
#define vec_load_f16(src) vec_from_f16(_mm256_loadu_si256((const __m256i *)(src)))
#define vec_to_f16(x) _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)
#define vec_u16_storeu(dst, h) _mm256_storeu_si256(dst, h)
#define vec_u16_stream(dst, h) _mm256_stream_si256(dst, h)

INF_ADAM__SIMD_INLINE vec_f32 vec_load_bf16(const uint16_t *src)
{
    __m256i h = _mm256_loadu_si256((const __m256i *)src);

    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* See [Note: lowp rounding] in inf_adam.h: the bf16 bits in each 32-bit lane. */
INF_ADAM__SIMD_INLINE __m512i vec_bf16_bits(vec_f32 p)
{
    __m512i u = _mm512_castps_si512(p);
    __m512i top = _mm512_srli_epi32(u, 16);
    __m512i bias = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),
                                    _mm512_and_si512(top, _mm512_set1_epi32(1)));
    __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    __m512i quiet = _mm512_or_si512(top, _mm512_set1_epi32(0x40));
    __mmask16 nan = _mm512_cmp_ps_mask(p, p, _CMP_UNORD_Q);
    return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

/* Every lane is <= 0xffff, so truncating each to 16 bits only narrows. */
#define vec_pack_u16(r) _mm512_cvtepi32_epi16(r)
#define vec_to_bf16(p) vec_pack_u16(vec_bf16_bits(p))
#define vec_pack_hi16(x) vec_pack_u16(_mm512_srli_epi32(x, 16))
#define vec_store_u16x2(a, b, x, y)                                                          \
    (_mm256_storeu_si256((__m256i *)(a), vec_pack_u16(x)),                                   \
     _mm256_storeu_si256((__m256i *)(b), vec_pack_u16(y)))

typedef __m512d vec_f64;

#define vec_f64_zero() _mm512_setzero_pd()
#define vec_f64_fmadd(x, y, z) _mm512_fmadd_pd(x, y, z)
#define vec_f64_storeu(dst, x) _mm512_storeu_pd(dst, x)
#define vec_f64_lo(f) _mm512_cvtps_pd(_mm512_castps512_ps256(f))
#define vec_f64_hi(f) \
    _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(f), 1)))

#include "adam_simd_body.h"

INF_ADAM__AVX512 void inf_adam__range_avx512(const struct inf_adam__coef *c,
                                             const struct inf_adam__arrays *a, size_t lo,
                                             size_t hi)
{
    simd_range(c, a, lo, hi);
}

INF_ADAM__AVX512 size_t inf_adam__sum_squares_avx512(const void *x, int dtype, size_t n,
                                                     double *acc)
{
    return simd_sum_squares(x, dtype, n, acc);
}

/* The operations adam_state_simd_body.h asks for; masks are AVX-512 mask registers. Only
 * AVX-512 F instructions: float and/or/andnot (AVX-512 DQ) go through the integer ones. */
#define INF_ADAM__SIMD_FN static INF_ADAM__AVX512

typedef __m512i vec_i32;
typedef __mmask16 vec_mask;

#define vec_abs(x) _mm512_castsi512_ps(_mm512_and_si512(_mm512_castps_si512(x), \
                                                        _mm512_set1_epi32(0x7fffffff)))
#define vec_as_i32(x) _mm512_castps_si512(x)
#define vec_as_f32(x) _mm512_castsi512_ps(x)
#define vec_i32_set1(x) _mm512_set1_epi32(x)
#define vec_i32_add(x, y) _mm512_add_epi32(x, y)
#define vec_i32_and(x, y) _mm512_and_si512(x, y)
#define vec_i32_or(x, y) _mm512_or_si512(x, y)
#define vec_i32_xor(x, y) _mm512_xor_si512(x, y)
#define vec_i32_mullo(x, y) _mm512_mullo_epi32(x, y)
#define vec_i32_min(x, y) _mm512_min_epi32(x, y)
#define vec_i32_max(x, y) _mm512_max_epi32(x, y)
#define vec_i32_srli(x, n) _mm512_srli_epi32(x, n)
#define vec_i32_slli(x, n) _mm512_slli_epi32(x, n)
#define vec_iota() _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)
#define vec_lt(x, y) _mm512_cmp_ps_mask(x, y, _CMP_LT_OQ)
#define vec_not_le(x, y) _mm512_cmp_ps_mask(x, y, _CMP_NLE_UQ)
#define vec_is_nan(x) _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)
#define vec_mask_any(x) ((x) != 0)
#define vec_select(m, t, f) _mm512_mask_blend_ps(m, f, t)
#define vec_i32_select(m, t, f) _mm512_mask_blend_epi32(m, f, t)
/* 16-bit lanes of 256 bits: AVX2 instructions, which every AVX-512 F CPU has (and the target
 * implies) */
#define vec_load_u8_u16(src) _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)(src)))
#define vec_load_s8_u16(src) _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(src)))
#define vec_u16_set1(x) _mm256_set1_epi16(x)
#define vec_u16_and(x, y) _mm256_and_si256(x, y)
#define vec_u16_slli(x, n) _mm256_slli_epi16(x, n)
#define vec_store_u8(dst, x) _mm_storeu_si128((__m128i *)(dst), _mm512_cvtusepi32_epi8(x))
#define vec_i32_hmax(x) _mm512_reduce_max_epi32(x)

/* The packs that would narrow four vectors at once are AVX-512 BW: one narrow each; m's sign
 * by a test into a mask and a masked or. */
INF_ADAM__SIMD_INLINE void vec_store_u8x4_signs(uint8_t *dst, const vec_i32 *code,
                                                const vec_f32 *y)
{
    const __m512i sign = _mm512_set1_epi32((int32_t)0x80000000u);

    for (int j = 0; j < 4; j++) {
        __mmask16 neg = _mm512_test_epi32_mask(_mm512_castps_si512(y[j]), sign);

        vec_store_u8(dst + 16 * j, _mm512_mask_or_epi32(code[j], neg, code[j],
                                                        _mm512_set1_epi32(0x80)));
    }
}

INF_ADAM__SIMD_INLINE void vec_store_u8x4_nonzero(uint8_t *dst, const vec_i32 *code,
                                                  const vec_f32 *y)
{
    for (int j = 0; j < 4; j++)
        vec_store_u8(dst + 16 * j, _mm512_max_epi32(code[j], _mm512_min_epi32(
            _mm512_castps_si512(y[j]), _mm512_set1_epi32(1))));
}

#define INF_ADAM__SPLIT_Q8 0  /* [Note: 8-bit update in two passes]: no gain on Zen 4 */
#include "adam_state_simd_body.h"

const struct inf_adam__state_isa inf_adam__state_avx512 = {
    state_convert, state_update, state_encode_m, state_encode_v,
};

#endif /* x86 */
