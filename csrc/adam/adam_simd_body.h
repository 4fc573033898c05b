/*
 * The SIMD inner loop of inf_adam, written once for every vector width; see [Note: one formula]
 * in adam_kernel.h. Not a header of its own: each ISA adapter (adam_avx2.c, adam_avx512.c)
 * includes it once, after defining for its vector type
 *
 *   INF_ADAM__SIMD_INLINE    `static inline` with always_inline and the ISA's target attribute
 *   vec_f32, vec_u16         a vector of floats, and a vector of as many 16-bit values
 *   vec_set1, vec_loadu, vec_storeu, vec_add, vec_sub, vec_mul, vec_div, vec_sqrt, vec_fmadd
 *                            the float operations, each one instruction
 *   vec_load_bf16, vec_load_f16
 *                            load a vector of 16-bit values (unaligned), widened exactly to float
 *   vec_to_bf16, vec_to_f16  narrow to 16 bits as [Note: lowp rounding] in inf_adam.h says
 *   vec_u16_storeu, vec_u16_stream
 *                            store a vec_u16, unaligned or non-temporal (aligned to its size)
 *   vec_f64                  a vector of doubles, half as many lanes as vec_f32
 *   vec_f64_zero, vec_f64_fmadd, vec_f64_storeu
 *                            the double operations the sum of squares needs
 *   vec_f64_lo, vec_f64_hi   the low and the high half of a vec_f32, widened exactly to double
 *
 * and gets the static `simd_range` and `simd_sum_squares`, which its exported
 * inf_adam__range_<isa> and inf_adam__sum_squares_<isa> call. Unaligned loads and stores, the
 * tail through the scalar update.
 */
#ifndef INF_ADAM__SIMD_INLINE
#error "adam_simd_body.h is included only by an ISA adapter (adam_avx2.c, adam_avx512.c)"
#endif

/* Floats per vector. */
#define INF_ADAM__SIMD_WIDTH (sizeof(vec_f32) / sizeof(float))

INF_ADAM__SIMD_INLINE vec_f32 load_grad(const void *grad, size_t i, int dtype)
{
    if (dtype == INF_ADAM_DTYPE_BF16)
        return vec_load_bf16((const uint16_t *)grad + i);
    if (dtype == INF_ADAM_DTYPE_F16)
        return vec_load_f16((const uint16_t *)grad + i);
    return vec_loadu((const float *)grad + i);
}

/* Non-temporal when asked and aligned: the copy is not read again soon, so it should not
 * evict the state arrays from cache or cost a read-for-ownership of each line. */
INF_ADAM__SIMD_INLINE void store_out(void *out, size_t i, vec_f32 p, int dtype, int stream)
{
    vec_u16 h, *dst;

    if (dtype == INF_ADAM_DTYPE_BF16)
        h = vec_to_bf16(p);
    else if (dtype == INF_ADAM_DTYPE_F16)
        h = vec_to_f16(p);
    else
        return;
    dst = (vec_u16 *)((uint16_t *)out + i);
    if (stream && (uintptr_t)dst % sizeof(vec_u16) == 0)
        vec_u16_stream(dst, h);
    else
        vec_u16_storeu(dst, h);
}

/* grad_dtype and out_dtype are constants at each call site, so each gets its own loop. */
INF_ADAM__SIMD_INLINE void run(const struct inf_adam__coef *c, const struct inf_adam__arrays *a,
                               size_t lo, size_t hi, int grad_dtype, int out_dtype)
{
    const vec_f32 grad_scale = vec_set1(c->grad_scale);
    const vec_f32 weight_decay = vec_set1(c->weight_decay);
    const vec_f32 decay = vec_set1(c->decay);
    const vec_f32 lerp_w = vec_set1(c->lerp_w);
    const vec_f32 beta2 = vec_set1(c->beta2);
    const vec_f32 one_minus_beta2 = vec_set1(c->one_minus_beta2);
    const vec_f32 bc2_sqrt = vec_set1(c->bc2_sqrt);
    const vec_f32 eps = vec_set1(c->eps);
    const vec_f32 step_size = vec_set1(c->step_size);
    size_t i = lo;

    for (; i + INF_ADAM__SIMD_WIDTH <= hi; i += INF_ADAM__SIMD_WIDTH) {
        inf_adam__prefetch(a, i);
        vec_f32 g = vec_mul(load_grad(a->grad, i, grad_dtype), grad_scale);
        vec_f32 p = vec_loadu(a->param + i);
        vec_f32 m = vec_loadu(a->exp_avg + i);
        vec_f32 v = vec_loadu(a->exp_avg_sq + i);
        vec_f32 d;

        if (c->l2)
            g = vec_fmadd(p, weight_decay, g);
        if (c->decoupled)
            p = vec_mul(p, decay);
        m = vec_fmadd(lerp_w, vec_sub(g, m), c->lerp_big ? g : m);
        v = vec_fmadd(vec_mul(one_minus_beta2, g), g, vec_mul(v, beta2));
        d = vec_add(vec_div(vec_sqrt(v), bc2_sqrt), eps);
        p = vec_sub(p, vec_div(vec_mul(step_size, m), d));

        vec_storeu(a->param + i, p);
        vec_storeu(a->exp_avg + i, m);
        vec_storeu(a->exp_avg_sq + i, v);
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

INF_ADAM__SIMD_INLINE void simd_range(const struct inf_adam__coef *c,
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

#undef INF_ADAM__CASE

/* Doubles per vector, and the vectors that hold the INF_ADAM__SUMSQ_LANES accumulators. */
#define INF_ADAM__F64_WIDTH (INF_ADAM__SIMD_WIDTH / 2)
#define INF_ADAM__F64_ACCS (INF_ADAM__SUMSQ_LANES / INF_ADAM__F64_WIDTH)

/* Element i squared into accumulator lane i % INF_ADAM__SUMSQ_LANES, whatever the vector width:
 * accumulator vector 2k takes the low half of the block's k-th vec_f32, 2k + 1 its high half. */
INF_ADAM__SIMD_INLINE size_t sum_squares_run(const void *x, int dtype, size_t n, double *acc)
{
    vec_f64 sums[INF_ADAM__F64_ACCS];
    size_t i = 0;

    for (size_t k = 0; k < INF_ADAM__F64_ACCS; k++)
        sums[k] = vec_f64_zero();
    for (; i + INF_ADAM__SUMSQ_LANES <= n; i += INF_ADAM__SUMSQ_LANES) {
        for (size_t k = 0; k < INF_ADAM__F64_ACCS / 2; k++) {
            vec_f32 f = load_grad(x, i + k * INF_ADAM__SIMD_WIDTH, dtype);
            vec_f64 lo = vec_f64_lo(f), hi = vec_f64_hi(f);

            sums[2 * k] = vec_f64_fmadd(lo, lo, sums[2 * k]);
            sums[2 * k + 1] = vec_f64_fmadd(hi, hi, sums[2 * k + 1]);
        }
    }
    for (size_t k = 0; k < INF_ADAM__F64_ACCS; k++)
        vec_f64_storeu(acc + k * INF_ADAM__F64_WIDTH, sums[k]);
    return i;
}

/* One loop per dtype, so load_grad's choice is made once, not per vector. */
INF_ADAM__SIMD_INLINE size_t simd_sum_squares(const void *x, int dtype, size_t n, double *acc)
{
    if (dtype == INF_ADAM_DTYPE_BF16)
        return sum_squares_run(x, INF_ADAM_DTYPE_BF16, n, acc);
    if (dtype == INF_ADAM_DTYPE_F16)
        return sum_squares_run(x, INF_ADAM_DTYPE_F16, n, acc);
    return sum_squares_run(x, INF_ADAM_DTYPE_F32, n, acc);
}
