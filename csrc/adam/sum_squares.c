/*
 * inf_adam_sum_squares: a gradient's sum of squares in double, in one pass over its own bytes.
 *
 * Why here: the engine needs each gradient's sum of squares (the global norm gradient clipping
 * scales by) and whether it is finite, while backward goes on, on the thread backward runs on.
 * torch reduces a bf16 tensor by converting it into a float32 temporary first (three passes
 * over twice the bytes); this reads the bf16 once and settles both questions.
 *
 * [Note: one sum on every path] Element i of the array goes to lane i % 32 of 32 double
 * accumulators; the lanes are then added pairwise (lane k += lane k + 16, then + 8, ...). Each
 * square is exact in double (a float's 24-bit significand squared fits in 53 bits), so a fused
 * multiply-add and a multiply then an add round the same, and the AVX-512 (4 x 8 lanes), AVX2
 * (8 x 4 lanes) and scalar paths give the same bits. No float squares overflow a double
 * (FLT_MAX^2 is about 1e77), so the sum is finite exactly when every element is.
 */
#include <errno.h>
#include <stdint.h>
#include <string.h>

#include "adam_kernel.h"

#define INF_SUMSQ__LANES 32

/* Adds element i of x (dtype) squared into lane i % 32, for i in [from, to). */
static void inf_sumsq__scalar_range(const void *x, int dtype, size_t from, size_t to,
                                    double acc[INF_SUMSQ__LANES])
{
    for (size_t i = from; i < to; i++) {
        double v;

        if (dtype == INF_ADAM_DTYPE_BF16)
            v = inf_adam__bf16_to_f32(((const uint16_t *)x)[i]);
        else if (dtype == INF_ADAM_DTYPE_F16)
            v = inf_adam__f16_to_f32(((const uint16_t *)x)[i]);
        else
            v = ((const float *)x)[i];
        acc[i % INF_SUMSQ__LANES] += v * v;
    }
}

#if defined(__x86_64__) || defined(__i386__)

#include <immintrin.h>

#define INF_SUMSQ__AVX512 __attribute__((target("avx512f")))
#define INF_SUMSQ__AVX2 __attribute__((target("avx2,fma,f16c")))

/* 16 elements from x + i as floats (exact). */
static inline __attribute__((always_inline, target("avx512f")))
__m512 inf_sumsq__load16(const void *x, int dtype, size_t i)
{
    if (dtype == INF_ADAM_DTYPE_F32)
        return _mm512_loadu_ps((const float *)x + i);
    __m256i h = _mm256_loadu_si256((const __m256i *)((const uint16_t *)x + i));
    if (dtype == INF_ADAM_DTYPE_F16)
        return _mm512_cvtph_ps(h);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

INF_SUMSQ__AVX512 static size_t inf_sumsq__avx512(const void *x, int dtype, size_t n,
                                                 double acc[INF_SUMSQ__LANES])
{
    __m512d a0 = _mm512_setzero_pd(), a1 = a0, a2 = a0, a3 = a0;
    size_t i = 0;

    for (; i + INF_SUMSQ__LANES <= n; i += INF_SUMSQ__LANES) {
        __m512 f = inf_sumsq__load16(x, dtype, i), g = inf_sumsq__load16(x, dtype, i + 16);
        __m512d f0 = _mm512_cvtps_pd(_mm512_castps512_ps256(f));
        __m512d f1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
            _mm512_castps_pd(f), 1)));
        __m512d g0 = _mm512_cvtps_pd(_mm512_castps512_ps256(g));
        __m512d g1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(
            _mm512_castps_pd(g), 1)));

        a0 = _mm512_fmadd_pd(f0, f0, a0);
        a1 = _mm512_fmadd_pd(f1, f1, a1);
        a2 = _mm512_fmadd_pd(g0, g0, a2);
        a3 = _mm512_fmadd_pd(g1, g1, a3);
    }
    _mm512_storeu_pd(acc, a0);
    _mm512_storeu_pd(acc + 8, a1);
    _mm512_storeu_pd(acc + 16, a2);
    _mm512_storeu_pd(acc + 24, a3);
    return i;
}

/* 8 elements from x + i as floats (exact). */
static inline __attribute__((always_inline, target("avx2,fma,f16c")))
__m256 inf_sumsq__load8(const void *x, int dtype, size_t i)
{
    if (dtype == INF_ADAM_DTYPE_F32)
        return _mm256_loadu_ps((const float *)x + i);
    __m128i h = _mm_loadu_si128((const __m128i *)((const uint16_t *)x + i));
    if (dtype == INF_ADAM_DTYPE_F16)
        return _mm256_cvtph_ps(h);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

INF_SUMSQ__AVX2 static size_t inf_sumsq__avx2(const void *x, int dtype, size_t n,
                                             double acc[INF_SUMSQ__LANES])
{
    __m256d a[8];
    size_t i = 0;

    for (int k = 0; k < 8; k++)
        a[k] = _mm256_setzero_pd();
    for (; i + INF_SUMSQ__LANES <= n; i += INF_SUMSQ__LANES) {
        for (int k = 0; k < 4; k++) {
            __m256 f = inf_sumsq__load8(x, dtype, i + 8 * (size_t)k);
            __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(f));
            __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(f, 1));

            a[2 * k] = _mm256_fmadd_pd(lo, lo, a[2 * k]);
            a[2 * k + 1] = _mm256_fmadd_pd(hi, hi, a[2 * k + 1]);
        }
    }
    for (int k = 0; k < 8; k++)
        _mm256_storeu_pd(acc + 4 * k, a[k]);
    return i;
}

#endif

int inf_adam_sum_squares(const void *x, int dtype, size_t n, int isa, double *out)
{
    double acc[INF_SUMSQ__LANES] = {0};
    size_t done = 0;

    if (out == NULL || (x == NULL && n > 0))
        return -EINVAL;
    if (dtype != INF_ADAM_DTYPE_F32 && dtype != INF_ADAM_DTYPE_BF16 &&
        dtype != INF_ADAM_DTYPE_F16)
        return -EINVAL;
    if (inf_adam__misaligned(x, inf_adam__dtype_size(dtype)))
        return -EINVAL;
    isa = inf_adam_isa_resolve(isa);
    if (isa < 0)
        return isa;
#if defined(__x86_64__) || defined(__i386__)
    if (isa == INF_ADAM_ISA_AVX512)
        done = inf_sumsq__avx512(x, dtype, n, acc);
    else if (isa == INF_ADAM_ISA_AVX2)
        done = inf_sumsq__avx2(x, dtype, n, acc);
#endif
    inf_sumsq__scalar_range(x, dtype, done, n, acc);
    for (size_t width = INF_SUMSQ__LANES / 2; width >= 1; width /= 2)
        for (size_t k = 0; k < width; k++)
            acc[k] += acc[k + width];
    *out = acc[0];
    return 0;
}
