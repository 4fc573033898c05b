/*
 * AVX2 + FMA + F16C inner loops of inf_adam, 8 elements per iteration: the vector types and
 * their operations for the loops in adam_simd_body.h and adam_state_simd_body.h. Compiled for
 * any x86-64 and only called when the CPU has all three (checked in adam.c).
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
#define vec_from_f16(h) _mm256_cvtph_ps(h)
#define vec_load_f16(src) vec_from_f16(_mm_loadu_si128((const __m128i *)(src)))
#define vec_to_f16(x) _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)
#define vec_u16_storeu(dst, h) _mm_storeu_si128(dst, h)
#define vec_u16_stream(dst, h) _mm_stream_si128(dst, h)

/* The 8 values in both 128-bit halves (a load, no ALU work), then one byte shuffle puts each in
 * the top of its 32-bit lane and zeroes the rest (widening and shifting takes two). */
INF_ADAM__SIMD_INLINE vec_f32 vec_load_bf16(const uint16_t *src)
{
    __m256i h = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)src));

    return _mm256_castsi256_ps(_mm256_shuffle_epi8(h, _mm256_setr_epi8(
        -1, -1, 0, 1, -1, -1, 2, 3, -1, -1, 4, 5, -1, -1, 6, 7,
        -1, -1, 8, 9, -1, -1, 10, 11, -1, -1, 12, 13, -1, -1, 14, 15)));
}

/* See [Note: lowp rounding] in inf_adam.h: the bf16 bits in each 32-bit lane. */
INF_ADAM__SIMD_INLINE __m256i vec_bf16_bits(vec_f32 p)
{
    __m256i u = _mm256_castps_si256(p);
    __m256i top = _mm256_srli_epi32(u, 16);
    __m256i bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
                                    _mm256_and_si256(top, _mm256_set1_epi32(1)));
    __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    __m256i quiet = _mm256_or_si256(top, _mm256_set1_epi32(0x40));
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(p, p, _CMP_UNORD_Q));
    return _mm256_blendv_epi8(rounded, quiet, nan);
}

/* Every lane is <= 0xffff, so the unsigned-saturating pack only narrows. */
INF_ADAM__SIMD_INLINE vec_u16 vec_pack_u16(__m256i r)
{
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

#define vec_to_bf16(p) vec_pack_u16(vec_bf16_bits(p))

/* The top 16 bits of each lane: one byte shuffle gathers them in the low 8 bytes of each
 * 128-bit half, one permute joins the halves (a shift and vec_pack_u16 take three). */
INF_ADAM__SIMD_INLINE vec_u16 vec_pack_hi16(__m256i x)
{
    __m256i top = _mm256_shuffle_epi8(x, _mm256_setr_epi8(
        2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1,
        2, 3, 6, 7, 10, 11, 14, 15, -1, -1, -1, -1, -1, -1, -1, -1));

    return _mm256_castsi256_si128(_mm256_permute4x64_epi64(top, _MM_SHUFFLE(3, 1, 2, 0)));
}

/* Two vectors in one pack and one permute, instead of two shuffles each. */
INF_ADAM__SIMD_INLINE void vec_store_u16x2(uint16_t *a, uint16_t *b, __m256i x, __m256i y)
{
    __m256i xy = _mm256_permute4x64_epi64(_mm256_packus_epi32(x, y), _MM_SHUFFLE(3, 1, 2, 0));

    _mm_storeu_si128((__m128i *)a, _mm256_castsi256_si128(xy));
    _mm_storeu_si128((__m128i *)b, _mm256_extracti128_si256(xy, 1));
}

typedef __m256d vec_f64;

#define vec_f64_zero() _mm256_setzero_pd()
#define vec_f64_fmadd(x, y, z) _mm256_fmadd_pd(x, y, z)
#define vec_f64_storeu(dst, x) _mm256_storeu_pd(dst, x)
#define vec_f64_lo(f) _mm256_cvtps_pd(_mm256_castps256_ps128(f))
#define vec_f64_hi(f) _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1))

#include "adam_simd_body.h"

INF_ADAM__AVX2 void inf_adam__range_avx2(const struct inf_adam__coef *c,
                                         const struct inf_adam__arrays *a, size_t lo, size_t hi)
{
    simd_range(c, a, lo, hi);
}

INF_ADAM__AVX2 size_t inf_adam__sum_squares_avx2(const void *x, int dtype, size_t n, double *acc)
{
    return simd_sum_squares(x, dtype, n, acc);
}

/* The operations adam_state_simd_body.h asks for. */
#define INF_ADAM__SIMD_FN static INF_ADAM__AVX2

typedef __m256i vec_i32;
typedef __m256 vec_mask;  /* all-ones lanes where true */

#define vec_abs(x) _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x)
#define vec_as_i32(x) _mm256_castps_si256(x)
#define vec_as_f32(x) _mm256_castsi256_ps(x)
#define vec_i32_set1(x) _mm256_set1_epi32(x)
#define vec_i32_add(x, y) _mm256_add_epi32(x, y)
#define vec_i32_and(x, y) _mm256_and_si256(x, y)
#define vec_i32_or(x, y) _mm256_or_si256(x, y)
#define vec_i32_xor(x, y) _mm256_xor_si256(x, y)
#define vec_i32_mullo(x, y) _mm256_mullo_epi32(x, y)
#define vec_i32_min(x, y) _mm256_min_epi32(x, y)
#define vec_i32_max(x, y) _mm256_max_epi32(x, y)
#define vec_i32_srli(x, n) _mm256_srli_epi32(x, n)
#define vec_i32_slli(x, n) _mm256_slli_epi32(x, n)
#define vec_iota() _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7)
#define vec_lt(x, y) _mm256_cmp_ps(x, y, _CMP_LT_OQ)
#define vec_not_le(x, y) _mm256_cmp_ps(x, y, _CMP_NLE_UQ)
#define vec_is_nan(x) _mm256_cmp_ps(x, x, _CMP_UNORD_Q)
#define vec_mask_any(x) (_mm256_movemask_ps(x) != 0)
#define vec_select(m, t, f) _mm256_blendv_ps(f, t, m)
#define vec_i32_select(m, t, f) _mm256_blendv_epi8(f, t, _mm256_castps_si256(m))

#define vec_load_u8_u16(src) _mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)(src)))
#define vec_load_s8_u16(src) _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(src)))
#define vec_u16_set1(x) _mm_set1_epi16(x)
#define vec_u16_and(x, y) _mm_and_si128(x, y)
#define vec_u16_slli(x, n) _mm_slli_epi16(x, n)

/* Unsigned saturation: packus narrows lanes in [0, 2^31) to min(x, 255). */
INF_ADAM__SIMD_INLINE void vec_store_u8(uint8_t *dst, vec_i32 x)
{
    __m128i words = _mm_packus_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));

    _mm_storel_epi64((__m128i *)dst, _mm_packus_epi16(words, words));
}

/* Four vectors of lanes in [0, 2^31) as bytes min(x, 255) in three packs (one pack per vector
 * loses to the shuffles): they work per 128-bit half, leaving the 4-byte groups a0-3 b0-3 c0-3
 * d0-3 | a4-7 ... d4-7. */
INF_ADAM__SIMD_INLINE __m256i pack_u8x4(const __m256i *x)
{
    return _mm256_packus_epi16(_mm256_packus_epi32(x[0], x[1]), _mm256_packus_epi32(x[2], x[3]));
}

/* One permute puts the packs' groups in order. */
INF_ADAM__SIMD_INLINE void store_packed_u8x4(uint8_t *dst, __m256i bytes)
{
    _mm256_storeu_si256((__m256i *)dst, _mm256_permutevar8x32_epi32(
        bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

/* The bits of a float with the sign set are a negative integer, which signed packs saturate to
 * the byte 0x80, and the rest to 0-0x7f: three packs and two logic operations per 32 signs
 * instead of three operations per 8. */
INF_ADAM__SIMD_INLINE void vec_store_u8x4_signs(uint8_t *dst, const __m256i *code,
                                                const __m256 *y)
{
    __m256i ab = _mm256_packs_epi32(_mm256_castps_si256(y[0]), _mm256_castps_si256(y[1]));
    __m256i cd = _mm256_packs_epi32(_mm256_castps_si256(y[2]), _mm256_castps_si256(y[3]));
    __m256i signs = _mm256_and_si256(_mm256_packs_epi16(ab, cd), _mm256_set1_epi8((char)0x80));

    store_packed_u8x4(dst, _mm256_or_si256(pack_u8x4(code), signs));
}

/* The bits of floats >= +0 are non-negative integers, which the signed then unsigned packs keep
 * nonzero where they are nonzero. */
INF_ADAM__SIMD_INLINE void vec_store_u8x4_nonzero(uint8_t *dst, const __m256i *code,
                                                  const __m256 *y)
{
    __m256i ab = _mm256_packs_epi32(_mm256_castps_si256(y[0]), _mm256_castps_si256(y[1]));
    __m256i cd = _mm256_packs_epi32(_mm256_castps_si256(y[2]), _mm256_castps_si256(y[3]));
    __m256i nonzero = _mm256_min_epu8(_mm256_packus_epi16(ab, cd), _mm256_set1_epi8(1));

    store_packed_u8x4(dst, _mm256_max_epu8(pack_u8x4(code), nonzero));
}

INF_ADAM__SIMD_INLINE int32_t vec_i32_hmax(vec_i32 x)
{
    __m128i m = _mm_max_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));

    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(1, 0, 3, 2)));
    m = _mm_max_epi32(m, _mm_shuffle_epi32(m, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm_cvtsi128_si32(m);
}

#define INF_ADAM__SPLIT_Q8 1  /* [Note: 8-bit update in two passes]: faster on Zen 3 */
#include "adam_state_simd_body.h"

const struct inf_adam__state_isa inf_adam__state_avx2 = {
    state_convert, state_update, state_encode_m, state_encode_v,
};

#endif /* x86 */
