/*
 * Portable inner loops of inf_adam_step and inf_adam_state_step: one element at a time, for
 * CPUs without AVX2 and as the reference the SIMD loops must equal bit for bit (see
 * [Note: one formula] in adam_kernel.h and adam_state_kernel.h).
 */
#include "adam_state_kernel.h"

void inf_adam__range_scalar(const struct inf_adam__coef *c, const struct inf_adam__arrays *a,
                            size_t lo, size_t hi)
{
    for (size_t i = lo; i < hi; i++)
        inf_adam__update_one(c, a, i);
}

static void state_convert(float *dst, const void *src, int dtype, size_t n)
{
    for (size_t k = 0; k < n; k++)
        dst[k] = inf_adam__load_any(src, dtype, k);
}

static void state_update(const struct inf_adam__state_coef *c, const struct inf_adam_segment *s,
                         const struct inf_adam__block *b, size_t n, struct inf_adam__amax *amax)
{
    for (size_t k = 0; k < n; k++) {
        for (size_t i = b[k].lo; i < b[k].hi; i++)
            inf_adam__moments_one(c, s, &b[k], i, &amax[k]);
        for (size_t i = b[k].lo; i < b[k].hi; i++)
            inf_adam__param_one(c, s, &b[k], i);
    }
}

static void state_encode_m(uint8_t *dst, const float *src, size_t n, float scale, float inv)
{
    for (size_t k = 0; k < n; k++)
        dst[k] = inf_adam__q8_encode_m(src[k], scale, inv);
}

static void state_encode_v(uint8_t *dst, const float *src, size_t n, float scale, float inv)
{
    for (size_t k = 0; k < n; k++)
        dst[k] = inf_adam__q8_encode_v(src[k], scale, inv);
}

const struct inf_adam__state_isa inf_adam__state_scalar = {
    state_convert, state_update, state_encode_m, state_encode_v,
};
