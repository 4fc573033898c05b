/*
 * inf_adam_state_step driver: checks the segment, turns the hyperparameters into the float
 * coefficients and the rounding key of one step, and runs the blocks of the segment on the
 * caller's threads. Per block (8-bit: a quantization block; else INF_ADAM__STATE_UNIT
 * elements) it gathers the gradient pieces into one scaled float buffer; the ISA's update runs
 * the blocks in runs of INF_ADAM__STATE_RUN elements, and for 8-bit moments each block's new
 * scales are set and its moments coded after the next run's update (inf_adam__state_work).
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "adam_state_kernel.h"

/* The whole call, shared by its threads (read only). */
struct inf_adam__state_job {
    struct inf_adam__state_coef coef;
    const struct inf_adam_segment *seg;
    const struct inf_adam__state_isa *isa;
    size_t unit;                        /* elements per block */
};

/* Where a walk through the gradient pieces stands: `piece` holds elements from `start`. */
struct inf_adam__grad_cursor {
    const struct inf_adam_grad *piece;
    size_t start;
};

static uint64_t inf_adam__mix64(uint64_t z)
{
    z ^= z >> 30;
    z *= 0xbf58476d1ce4e5b9ull;
    z ^= z >> 27;
    z *= 0x94d049bb133111ebull;
    z ^= z >> 31;
    return z;
}

/* Round each hyperparameter to float once; see inf_adam.h and [Note: stochastic rounding]. */
static void inf_adam__state_coef_init(struct inf_adam__state_coef *c,
                                      const struct inf_adam_params *p, uint64_t seed)
{
    double step = (double)p->step;
    uint64_t key = inf_adam__mix64(inf_adam__mix64(seed + 0x9e3779b97f4a7c15ull) ^
                                   (uint64_t)p->step);

    c->grad_scale = (float)p->grad_scale;
    c->weight_decay = (float)p->weight_decay;
    c->decay = (float)(1.0 - p->lr * p->weight_decay);
    c->beta1 = (float)p->beta1;
    c->one_minus_beta1 = (float)(1.0 - p->beta1);
    c->beta2 = (float)p->beta2;
    c->one_minus_beta2 = (float)(1.0 - p->beta2);
    c->inv_bc2_sqrt = (float)(1.0 / sqrt(1.0 - pow(p->beta2, step)));
    c->eps = (float)p->eps;
    c->step_size = (float)(p->lr / (1.0 - pow(p->beta1, step)));
    c->l2 = !p->adamw && p->weight_decay != 0.0;
    c->decoupled = p->adamw && p->weight_decay != 0.0;
    c->key0 = (uint32_t)key;
    c->key1 = (uint32_t)(key >> 32);
}

static const struct inf_adam__state_isa *inf_adam__state_isa_for(int isa)
{
#if defined(__x86_64__) || defined(__i386__)
    if (isa == INF_ADAM_ISA_AVX512)
        return &inf_adam__state_avx512;
    if (isa == INF_ADAM_ISA_AVX2)
        return &inf_adam__state_avx2;
#endif
    (void)isa;
    return &inf_adam__state_scalar;
}

static size_t inf_adam__moment_size(int moments)
{
    switch (moments) {
    case INF_ADAM_MOMENTS_F32:
        return 4;
    case INF_ADAM_MOMENTS_BF16:
        return 2;
    case INF_ADAM_MOMENTS_Q8:
        return 1;
    default:
        return 0;
    }
}

/* Most byte ranges one segment names: 6 arrays plus the gradient pieces (checked one by one). */
#define INF_ADAM__SEG_SPANS 6

struct inf_adam__span {
    const void *ptr;
    size_t bytes;
    size_t align;
};

static int inf_adam__check_span(const struct inf_adam__span *s, const struct inf_adam__span *others,
                                int nothers)
{
    if (s->bytes == 0)
        return 0;
    if (!s->ptr || inf_adam__misaligned(s->ptr, s->align))
        return -EINVAL;
    for (int j = 0; j < nothers; j++)
        if (others[j].bytes && inf_adam__overlap(s->ptr, s->bytes, others[j].ptr, others[j].bytes))
            return -EINVAL;
    return 0;
}

static int inf_adam__check_grads(const struct inf_adam_segment *s,
                                 const struct inf_adam__span *arrays, int narrays)
{
    size_t total = 0;

    if (s->grad_pieces && !s->grad)
        return -EINVAL;
    for (size_t k = 0; k < s->grad_pieces; k++) {
        const struct inf_adam_grad *g = &s->grad[k];
        size_t size = inf_adam__dtype_size(g->dtype);
        struct inf_adam__span span = {g->data, g->n * size, size};

        if (size == 0 || g->n > SIZE_MAX / 4 || g->n > s->n - total)
            return -EINVAL;
        total += g->n;
        if (inf_adam__check_span(&span, arrays, narrays) < 0)
            return -EINVAL;
    }
    return total == s->n ? 0 : -EINVAL;
}

static int inf_adam__check_segment(const struct inf_adam_segment *s)
{
    size_t msize = inf_adam__moment_size(s->moments);
    int q8 = s->moments == INF_ADAM_MOMENTS_Q8;
    size_t blocks, vsize = inf_adam__dtype_size(s->values_dtype);
    struct inf_adam__span spans[INF_ADAM__SEG_SPANS];

    if (msize == 0 || (s->master && s->moments == INF_ADAM_MOMENTS_F32))
        return -EINVAL;
    if (s->values_dtype != INF_ADAM_DTYPE_NONE && vsize != 2)
        return -EINVAL;
    if (!s->master && s->values_dtype == INF_ADAM_DTYPE_NONE)
        return -EINVAL;
    if ((s->values_dtype == INF_ADAM_DTYPE_NONE) != (s->values == NULL))
        return -EINVAL;
    if (q8 && (s->block % 64 || s->block < INF_ADAM_BLOCK_MIN || s->block > INF_ADAM_BLOCK_MAX))
        return -EINVAL;
    if (!q8 && (s->exp_avg_scale || s->exp_avg_sq_scale))
        return -EINVAL;
    if (s->n > SIZE_MAX / 4 || (s->n && s->index > UINT64_MAX - (s->n - 1)))
        return -EINVAL;
    blocks = q8 ? (s->n + s->block - 1) / s->block : 0;
    spans[0] = (struct inf_adam__span){s->master, s->master ? s->n * 4 : 0, 4};
    spans[1] = (struct inf_adam__span){s->values, s->n * vsize, 2};
    spans[2] = (struct inf_adam__span){s->exp_avg, s->n * msize, msize};
    spans[3] = (struct inf_adam__span){s->exp_avg_sq, s->n * msize, msize};
    spans[4] = (struct inf_adam__span){s->exp_avg_scale, blocks * 4, 4};
    spans[5] = (struct inf_adam__span){s->exp_avg_sq_scale, blocks * 4, 4};
    for (int i = 0; i < INF_ADAM__SEG_SPANS; i++)
        if (inf_adam__check_span(&spans[i], spans, i) < 0)
            return -EINVAL;
    return inf_adam__check_grads(s, spans, INF_ADAM__SEG_SPANS);
}

static void inf_adam__cursor_seek(struct inf_adam__grad_cursor *cur,
                                  const struct inf_adam_segment *s, size_t at)
{
    cur->piece = s->grad;
    cur->start = 0;
    while (cur->start + cur->piece->n <= at) {
        cur->start += cur->piece->n;
        cur->piece++;
    }
}

/* Move past the piece that ends at element `at` (and any empty ones after it). */
static void inf_adam__cursor_next(const struct inf_adam__state_job *job,
                                  struct inf_adam__grad_cursor *cur, size_t at)
{
    if (at == job->seg->n)
        return;
    cur->start = at;
    cur->piece++;
    while (cur->piece->n == 0)
        cur->piece++;
}

/* Point b at the gradient of its elements: in place when one piece holds them all (the common
 * case), else gathered into g as float from as many pieces as hold them. */
static void inf_adam__gather(const struct inf_adam__state_job *job,
                             struct inf_adam__grad_cursor *cur, struct inf_adam__block *b,
                             float *g)
{
    size_t at = b->lo, lo = b->lo, hi = b->hi;

    if (cur->start + cur->piece->n >= hi) {
        b->grad = (const char *)cur->piece->data +
                  (lo - cur->start) * inf_adam__dtype_size(cur->piece->dtype);
        b->grad_dtype = cur->piece->dtype;
        if (cur->start + cur->piece->n == hi)
            inf_adam__cursor_next(job, cur, hi);
        return;
    }
    b->grad = g;
    b->grad_dtype = INF_ADAM_DTYPE_F32;
    while (at < hi) {
        const struct inf_adam_grad *piece = cur->piece;
        size_t end = cur->start + piece->n < hi ? cur->start + piece->n : hi;
        const char *src = (const char *)piece->data +
                          (at - cur->start) * inf_adam__dtype_size(piece->dtype);

        job->isa->convert(g + (at - lo), src, piece->dtype, end - at);
        at = end;
        if (at == cur->start + piece->n)
            inf_adam__cursor_next(job, cur, at);
    }
}

/* An 8-bit block updated but not yet coded: its elements, its new moments and their scales. */
struct inf_adam__coded_block {
    size_t lo;
    size_t hi;
    const float *m;
    const float *v;
    float m_scale;
    float v_scale;
    float m_inv;
    float v_inv;
};

/* Set an 8-bit block's new scales and their inverses (the coding waits for them). */
static void inf_adam__scale_block(const struct inf_adam__state_job *job,
                                  struct inf_adam__coded_block *q,
                                  const struct inf_adam__amax *amax)
{
    size_t blk = q->lo / job->unit;

    q->m_scale = inf_adam__q8_scale(amax->m);
    q->v_scale = inf_adam__q8_scale(amax->v);
    q->m_inv = inf_adam__q8_inverse(q->m_scale);
    q->v_inv = inf_adam__q8_inverse(q->v_scale);
    job->seg->exp_avg_scale[blk] = q->m_scale;
    job->seg->exp_avg_sq_scale[blk] = q->v_scale;
}

/* Code an 8-bit block's new moments (all-zero and NaN blocks: bytes 0). */
static void inf_adam__code_block(const struct inf_adam__state_job *job,
                                 const struct inf_adam__coded_block *q)
{
    const struct inf_adam_segment *s = job->seg;
    size_t n = q->hi - q->lo;
    uint8_t *m_codes = (uint8_t *)s->exp_avg + q->lo, *v_codes = (uint8_t *)s->exp_avg_sq + q->lo;

    if (q->m_scale > 0.0f)
        job->isa->encode_m(m_codes, q->m, n, q->m_scale, q->m_inv);
    else
        memset(m_codes, 0, n);
    if (q->v_scale > 0.0f)
        job->isa->encode_v(v_codes, q->v, n, q->v_scale, q->v_inv);
    else
        memset(v_codes, 0, n);
}

/* Elements per call of the ISA's update: a run of blocks shares its setup (the coefficients in
 * vector registers, the format's dispatch); an 8-bit run's moments stay in L1 for the coding
 * (two runs of float m and v: 16 KiB). Blocks longer than this are runs of one. */
#define INF_ADAM__STATE_RUN 1024
#define INF_ADAM__RUN_MAX (INF_ADAM_BLOCK_MAX > INF_ADAM__STATE_RUN ? INF_ADAM_BLOCK_MAX \
                                                                    : INF_ADAM__STATE_RUN)
#define INF_ADAM__RUN_BLOCKS (INF_ADAM__STATE_RUN / INF_ADAM_BLOCK_MIN)

/* The blocks of [lo, hi) in order, in runs. An 8-bit run is coded after the next run's update
 * (its moments wait in the other of two buffers): its scales' reductions and divides, a chain
 * of some 30 cycles, then finish under that update instead of stalling the coding behind
 * them. */
static void inf_adam__state_work(const void *ctx, size_t lo, size_t hi)
{
    const struct inf_adam__state_job *job = ctx;
    const struct inf_adam_segment *s = job->seg;
    int q8 = s->moments == INF_ADAM_MOMENTS_Q8;
    size_t per_run = job->unit < INF_ADAM__STATE_RUN ? INF_ADAM__STATE_RUN / job->unit : 1;
    float g[INF_ADAM__RUN_MAX] __attribute__((aligned(64)));
    float m[2][INF_ADAM__RUN_MAX] __attribute__((aligned(64)));
    float v[2][INF_ADAM__RUN_MAX] __attribute__((aligned(64)));
    struct inf_adam__block blocks[INF_ADAM__RUN_BLOCKS];
    struct inf_adam__amax amax[INF_ADAM__RUN_BLOCKS];
    struct inf_adam__coded_block pending[INF_ADAM__RUN_BLOCKS];
    size_t npending = 0;
    struct inf_adam__grad_cursor cur;
    int buf = 0;

    inf_adam__cursor_seek(&cur, s, lo);
    for (size_t at = lo; at < hi; buf ^= 1) {
        size_t n = 0, off = 0;

        for (; n < per_run && at < hi; n++) {
            size_t end = hi - at < job->unit ? hi : at + job->unit;
            struct inf_adam__block *block = &blocks[n];

            *block = (struct inf_adam__block){at, end, NULL, 0, m[buf] + off, v[buf] + off,
                                              0.0f, 0.0f};
            if (q8) {
                block->m_scale = s->exp_avg_scale[at / job->unit];
                block->v_scale = s->exp_avg_sq_scale[at / job->unit];
            }
            inf_adam__gather(job, &cur, block, g + off);
            amax[n] = (struct inf_adam__amax){0, 0};
            off += end - at;
            at = end;
        }
        job->isa->update(&job->coef, s, blocks, n, amax);
        if (!q8)
            continue;
        for (size_t k = 0; k < npending; k++)
            inf_adam__code_block(job, &pending[k]);
        for (size_t k = 0; k < n; k++) {
            pending[k] = (struct inf_adam__coded_block){blocks[k].lo, blocks[k].hi, blocks[k].m,
                                                        blocks[k].v, 0.0f, 0.0f, 0.0f, 0.0f};
            inf_adam__scale_block(job, &pending[k], &amax[k]);
        }
        npending = n;
    }
    for (size_t k = 0; k < npending; k++)
        inf_adam__code_block(job, &pending[k]);
}

int inf_adam_state_step(const struct inf_adam_params *params, const struct inf_adam_segment *seg)
{
    struct inf_adam__state_job job;
    int isa, ret;

    if (!params || !seg || params->threads < 1 || params->step < 1)
        return -EINVAL;
    isa = inf_adam_isa_resolve(params->isa);
    if (isa < 0)
        return isa;
    ret = inf_adam__check_segment(seg);
    if (ret < 0 || seg->n == 0)
        return ret;

    inf_adam__state_coef_init(&job.coef, params, seg->seed);
    job.seg = seg;
    job.isa = inf_adam__state_isa_for(isa);
    job.unit = seg->moments == INF_ADAM_MOMENTS_Q8 ? seg->block : INF_ADAM__STATE_UNIT;
    inf_adam__run(inf_adam__state_work, &job, seg->n, job.unit, params->threads, params->pool);
    return 0;
}
