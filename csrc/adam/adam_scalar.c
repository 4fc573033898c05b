/*
 * Portable inner loop of inf_adam: one element at a time, for CPUs without AVX2 and as the
 * reference the SIMD loops must equal bit for bit (see [Note: one formula] in adam_kernel.h).
 */
#include "adam_kernel.h"

void inf_adam__range_scalar(const struct inf_adam__coef *c, const struct inf_adam__arrays *a,
                            size_t lo, size_t hi)
{
    for (size_t i = lo; i < hi; i++)
        inf_adam__update_one(c, a, i);
}
