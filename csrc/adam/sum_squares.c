/*
 * inf_adam_sum_squares: a gradient's sum of squares in double, in one pass over its own bytes.
 *
 * Why here: the engine needs each gradient's sum of squares (the global norm gradient clipping
 * scales by) and whether it is finite, while backward goes on, on the thread backward runs on.
 * torch reduces a bf16 tensor by converting it into a float32 temporary first (three passes
 * over twice the bytes); this reads the bf16 once and settles both questions.
 *
 * [Note: one sum on every path] Element i of the array goes to lane i % 32 of 32 double
 * accumulators (INF_ADAM__SUMSQ_LANES); the lanes are then added pairwise (lane k += lane k +
 * 16, then + 8, ...). Each square is exact in double (a float's 24-bit significand squared fits
 * in 53 bits), so a fused multiply-add and a multiply then an add round the same, and the
 * AVX-512 (4 x 8 lanes) and AVX2 (8 x 4 lanes) loops, written once in adam_simd_body.h, and the
 * scalar loop here give the same bits. No float squares overflow a double
 * (FLT_MAX^2 is about 1e77), so the sum is finite exactly when every element is.
 */
#include <errno.h>
#include <stdint.h>

#include "adam_kernel.h"

/* Adds element i of x (dtype) squared into lane i % INF_ADAM__SUMSQ_LANES, for i in [from, to). */
static void inf_sumsq__scalar_range(const void *x, int dtype, size_t from, size_t to,
                                    double acc[INF_ADAM__SUMSQ_LANES])
{
    for (size_t i = from; i < to; i++) {
        double v;

        if (dtype == INF_ADAM_DTYPE_BF16)
            v = inf_adam__bf16_to_f32(((const uint16_t *)x)[i]);
        else if (dtype == INF_ADAM_DTYPE_F16)
            v = inf_adam__f16_to_f32(((const uint16_t *)x)[i]);
        else
            v = ((const float *)x)[i];
        acc[i % INF_ADAM__SUMSQ_LANES] += v * v;
    }
}

int inf_adam_sum_squares(const void *x, int dtype, size_t n, int isa, double *out)
{
    double acc[INF_ADAM__SUMSQ_LANES] = {0};
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
        done = inf_adam__sum_squares_avx512(x, dtype, n, acc);
    else if (isa == INF_ADAM_ISA_AVX2)
        done = inf_adam__sum_squares_avx2(x, dtype, n, acc);
#endif
    inf_sumsq__scalar_range(x, dtype, done, n, acc);
    for (size_t width = INF_ADAM__SUMSQ_LANES / 2; width >= 1; width /= 2)
        for (size_t k = 0; k < width; k++)
            acc[k] += acc[k + width];
    *out = acc[0];
    return 0;
}
