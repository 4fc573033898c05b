/*
 * inf_adam driver: checks arguments, turns the double hyperparameters into the float
 * coefficients of one step, picks the inner loop for the instruction set, and spreads the array
 * over the caller's pool of threads. Each call owns everything else it uses.
 */
#include <errno.h>
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>

#include "adam_kernel.h"
#include "inf_pool.h"

/* Elements per work item, between these bounds: at least 64 KiB of each float array so every
 * thread streams long runs (prefetchers stay warm, few hand-overs), at most 1 MiB so a few
 * threads still get several items each and balance when one is slowed down. Items are whole
 * multiples of 64 elements, so only the array's end needs a scalar tail. */
#define INF_ADAM__CHUNK_MIN ((size_t)16384)
#define INF_ADAM__CHUNK_MAX ((size_t)262144)
/* Below this many elements per thread, starting a thread costs more than it saves. */
#define INF_ADAM__MIN_PER_THREAD ((size_t)65536)
/* A copy at least this large is written with non-temporal stores: it outgrows the caches before
 * anyone reads it, so caching it only evicts state and costs a read of every line it writes. */
#define INF_ADAM__STREAM_MIN_BYTES ((size_t)8 << 20)

/* Work shared by the threads of one call: items are taken in order from `next`. */
struct inf_adam__job {
    inf_adam__work_fn work;
    const void *ctx;
    size_t n;
    size_t chunk;         /* elements per item, a multiple of the caller's alignment */
    atomic_size_t next;
};

/* What inf_adam_step's items need: its coefficients, arrays and inner loop. */
struct inf_adam__step_ctx {
    const struct inf_adam__coef *coef;
    const struct inf_adam__arrays *arrays;
    inf_adam__range_fn range;
};

int inf_adam_isa_resolve(int isa)
{
#if defined(__x86_64__) || defined(__i386__)
    int has_avx512, has_avx2;

    __builtin_cpu_init();
    has_avx512 = __builtin_cpu_supports("avx512f");
    has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
#else
    const int has_avx512 = 0, has_avx2 = 0;
#endif

    switch (isa) {
    case INF_ADAM_ISA_AUTO:
        return has_avx512 ? INF_ADAM_ISA_AVX512 : has_avx2 ? INF_ADAM_ISA_AVX2
                                                            : INF_ADAM_ISA_SCALAR;
    case INF_ADAM_ISA_SCALAR:
        return INF_ADAM_ISA_SCALAR;
    case INF_ADAM_ISA_AVX2:
        return has_avx2 ? INF_ADAM_ISA_AVX2 : -ENOTSUP;
    case INF_ADAM_ISA_AVX512:
        return has_avx512 ? INF_ADAM_ISA_AVX512 : -ENOTSUP;
    default:
        return -EINVAL;
    }
}

static inf_adam__range_fn inf_adam__range_for(int isa)
{
#if defined(__x86_64__) || defined(__i386__)
    if (isa == INF_ADAM_ISA_AVX512)
        return inf_adam__range_avx512;
    if (isa == INF_ADAM_ISA_AVX2)
        return inf_adam__range_avx2;
#endif
    (void)isa;
    return inf_adam__range_scalar;
}

size_t inf_adam__dtype_size(int dtype)
{
    switch (dtype) {
    case INF_ADAM_DTYPE_F32:
        return 4;
    case INF_ADAM_DTYPE_BF16:
    case INF_ADAM_DTYPE_F16:
        return 2;
    default:
        return 0;
    }
}

int inf_adam__misaligned(const void *ptr, size_t align)
{
    return ((uintptr_t)ptr & (align - 1)) != 0;
}

/* Do [a, a + an) and [b, b + bn) share a byte? */
int inf_adam__overlap(const void *a, size_t an, const void *b, size_t bn)
{
    uintptr_t pa = (uintptr_t)a, pb = (uintptr_t)b;

    return pa < pb + bn && pb < pa + an;
}

static int inf_adam__check_arrays(const struct inf_adam__arrays *a, size_t n)
{
    size_t gsize = inf_adam__dtype_size(a->grad_dtype);
    size_t osize = inf_adam__dtype_size(a->out_dtype);
    size_t fbytes = n * sizeof(float);
    const void *spans[5] = {a->param, a->exp_avg, a->exp_avg_sq, a->grad, a->out};
    size_t sizes[5] = {fbytes, fbytes, fbytes, n * gsize, n * osize};
    int nspans = a->out_dtype == INF_ADAM_DTYPE_NONE ? 4 : 5;

    if (gsize == 0 || (a->out_dtype != INF_ADAM_DTYPE_NONE && osize != 2))
        return -EINVAL;
    if (n == 0)
        return 0;
    if (n > SIZE_MAX / sizeof(float))
        return -EINVAL;
    for (int i = 0; i < nspans; i++) {
        if (!spans[i])
            return -EINVAL;
        if (inf_adam__misaligned(spans[i], i < 3 ? sizeof(float) : i == 3 ? gsize : osize))
            return -EINVAL;
        for (int j = 0; j < i; j++)
            if (inf_adam__overlap(spans[i], sizes[i], spans[j], sizes[j]))
                return -EINVAL;
    }
    return 0;
}

/* Round each hyperparameter to float once, at the point torch would (see inf_adam.h). */
static void inf_adam__coef_init(struct inf_adam__coef *c, const struct inf_adam_params *p)
{
    double step = (double)p->step;
    double lerp_w = 1.0 - p->beta1;
    float lerp_wf = (float)lerp_w;

    c->grad_scale = (float)p->grad_scale;
    c->weight_decay = (float)p->weight_decay;
    c->decay = (float)(1.0 - p->lr * p->weight_decay);
    c->l2 = !p->adamw && p->weight_decay != 0.0;
    c->decoupled = p->adamw && p->weight_decay != 0.0;
    c->lerp_big = !(fabsf(lerp_wf) < 0.5f);
    c->lerp_w = c->lerp_big ? lerp_wf - 1.0f : lerp_wf;
    c->beta2 = (float)p->beta2;
    c->one_minus_beta2 = (float)(1.0 - p->beta2);
    c->bc2_sqrt = (float)pow(1.0 - pow(p->beta2, step), 0.5);
    c->eps = (float)p->eps;
    c->step_size = (float)(p->lr / (1.0 - pow(p->beta1, step)));
}

static void inf_adam__drain(struct inf_adam__job *job)
{
    for (;;) {
        size_t lo = atomic_fetch_add_explicit(&job->next, job->chunk, memory_order_relaxed);
        size_t hi;

        if (lo >= job->n)
            return;
        hi = job->n - lo < job->chunk ? job->n : lo + job->chunk;
        job->work(job->ctx, lo, hi);
    }
}

static void inf_adam__drain_job(void *job)
{
    inf_adam__drain(job);
}

static size_t inf_adam__round_up(size_t x, size_t align)
{
    return (x + align - 1) / align * align;
}

void inf_adam__run(inf_adam__work_fn work, const void *ctx, size_t n, size_t align, int threads,
                   struct inf_pool *pool)
{
    struct inf_adam__job job = {.work = work, .ctx = ctx, .n = n};
    size_t by_size = n / INF_ADAM__MIN_PER_THREAD;
    int want = pool ? threads : 1;

    if ((size_t)want > by_size)
        want = by_size > 1 ? (int)by_size : 1;
    /* about 8 items per thread, rounded up to whole cache lines of every array */
    job.chunk = inf_adam__round_up(n / ((size_t)want * 8), 64);
    if (job.chunk < INF_ADAM__CHUNK_MIN)
        job.chunk = INF_ADAM__CHUNK_MIN;
    if (job.chunk > INF_ADAM__CHUNK_MAX)
        job.chunk = INF_ADAM__CHUNK_MAX;
    job.chunk = inf_adam__round_up(job.chunk, align);
    atomic_init(&job.next, 0);
    if (want > 1)
        inf_pool_run(pool, inf_adam__drain_job, &job, want);
    else
        inf_adam__drain(&job);
}

static void inf_adam__step_work(const void *ctx, size_t lo, size_t hi)
{
    const struct inf_adam__step_ctx *step = ctx;

    step->range(step->coef, step->arrays, lo, hi);
}

int inf_adam_step(const struct inf_adam_params *params, float *param, const void *grad,
                  int grad_dtype, float *exp_avg, float *exp_avg_sq, void *out, int out_dtype,
                  size_t n)
{
    struct inf_adam__arrays arrays = {param, grad, exp_avg, exp_avg_sq, out, grad_dtype,
                                      out_dtype, 0};
    struct inf_adam__coef coef;
    struct inf_adam__step_ctx ctx = {&coef, &arrays, NULL};
    int isa, ret;

    if (!params || params->threads < 1 || params->step < 1)
        return -EINVAL;
    isa = inf_adam_isa_resolve(params->isa);
    if (isa < 0)
        return isa;
    ret = inf_adam__check_arrays(&arrays, n);
    if (ret < 0 || n == 0)
        return ret;

    inf_adam__coef_init(&coef, params);
    arrays.stream_out = out_dtype != INF_ADAM_DTYPE_NONE && n * 2 >= INF_ADAM__STREAM_MIN_BYTES;
    ctx.range = inf_adam__range_for(isa);
    inf_adam__run(inf_adam__step_work, &ctx, n, 64, params->threads, params->pool);
    return 0;
}
