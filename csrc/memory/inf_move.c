/* The moves of one compaction on several threads; see inf_move.h and [Note: only write-after-read]. */
#include "inf_move.h"
#include "inf_pool.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>

#define INF_MOVE__PIECE_MIN ((int64_t)64 << 10)     /* pieces are at least this long... */
#define INF_MOVE__PIECE_MAX ((int64_t)1 << 20)      /* ...and at most this long */
#define INF_MOVE__MIN_PER_THREAD ((int64_t)1 << 20) /* bytes moved per thread started */
#define INF_MOVE__MAX_THREADS 64
#define INF_MOVE__SPINS 4096                        /* pauses before a waiting thread sleeps */

/* A piece of one move. Before writing its target it waits for the earlier pieces
 * [wait_lo, wait_hi) to be done: exactly those whose sources the target overlaps. */
struct inf_move__piece {
    int64_t dst;
    int64_t src;
    int64_t nbytes;
    size_t wait_lo;
    size_t wait_hi;
};

struct inf_move__job {
    uint8_t *base;
    const struct inf_move__piece *pieces;
    atomic_uchar *done;         /* done[p] != 0 once piece p is copied (set under lock) */
    const size_t *chains;       /* chain c is pieces [chains[c], chains[c + 1]) */
    size_t nchains;
    atomic_size_t next;         /* the next chain to take; chains are taken in order */
    pthread_mutex_t lock;       /* with cond: sleep until more pieces are done */
    pthread_cond_t cond;
};

static inline void inf_move__pause(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Check the shape promised in inf_move.h; *moved gets the bytes to copy. */
static int inf_move__check(const uint8_t *base, size_t base_nbytes, const int64_t *dst,
                           const int64_t *src, const int64_t *nbytes, size_t count, int threads,
                           int64_t *moved)
{
    *moved = 0;
    if (threads < 1)
        return -EINVAL;
    if (count == 0)
        return 0;
    if (!base || !dst || !src || !nbytes)
        return -EINVAL;
    for (size_t i = 0; i < count; i++) {
        if (dst[i] < 0 || src[i] < dst[i] || nbytes[i] < 0 || (uint64_t)src[i] > base_nbytes ||
            (uint64_t)nbytes[i] > base_nbytes - (uint64_t)src[i])
            return -EINVAL;
        if (i > 0 && ((uint64_t)src[i] < (uint64_t)src[i - 1] + (uint64_t)nbytes[i - 1] ||
                      (uint64_t)dst[i] < (uint64_t)dst[i - 1] + (uint64_t)nbytes[i - 1]))
            return -EINVAL;
        if (dst[i] != src[i])
            *moved += nbytes[i];
    }
    return 0;
}

static void inf_move__sequential(uint8_t *base, const int64_t *dst, const int64_t *src,
                                 const int64_t *nbytes, size_t count)
{
    for (size_t i = 0; i < count; i++)
        if (nbytes[i] > 0 && dst[i] != src[i])
            memmove(base + dst[i], base + src[i], (size_t)nbytes[i]);
}

/* The pieces a move is cut into. A piece of at most gap / threads bytes lands on bytes that
 * the pieces `threads` places before it have read, so that many pieces of one move can be
 * copied at once; shorter than PIECE_MIN, a piece would cost more to hand out than to copy. */
static int64_t inf_move__piece_nbytes(int64_t gap, int threads)
{
    int64_t piece = (gap / threads) & ~(int64_t)4095;

    if (piece < INF_MOVE__PIECE_MIN)
        return INF_MOVE__PIECE_MIN;
    return piece > INF_MOVE__PIECE_MAX ? INF_MOVE__PIECE_MAX : piece;
}

static size_t inf_move__count_pieces(const int64_t *dst, const int64_t *src,
                                     const int64_t *nbytes, size_t count, int threads)
{
    size_t n = 0;

    for (size_t i = 0; i < count; i++) {
        if (nbytes[i] > 0 && dst[i] != src[i]) {
            int64_t piece = inf_move__piece_nbytes(src[i] - dst[i], threads);

            n += (size_t)((nbytes[i] + piece - 1) / piece);
        }
    }
    return n;
}

/* Cut the moves into pieces, find what each waits for, and group them into chains; returns the
 * number of chains. Sources and targets both ascend (pieces of one move ascend, moves ascend),
 * so two cursors that only go forward find, for each target, the first and one past the last
 * earlier source it overlaps. Its own source is left out: a piece that overlaps itself is one
 * memmove. A piece that waits for the one just before it cannot run beside it anyway, so it
 * joins that piece's chain, and one thread copies a whole chain: no hand-over between threads,
 * and the bytes a memmove just read are still in that core's cache when the next one writes
 * them (small gaps at the start of a compaction make chains). */
static size_t inf_move__cut(struct inf_move__piece *pieces, size_t *chains, const int64_t *dst,
                            const int64_t *src, const int64_t *nbytes, size_t count, int threads)
{
    size_t n = 0, lo = 0, hi = 0, nchains = 0;

    for (size_t i = 0; i < count; i++) {
        int64_t piece;

        if (nbytes[i] == 0 || dst[i] == src[i])
            continue;
        piece = inf_move__piece_nbytes(src[i] - dst[i], threads);
        for (int64_t at = 0; at < nbytes[i]; at += piece) {
            int64_t left = nbytes[i] - at;

            pieces[n].dst = dst[i] + at;
            pieces[n].src = src[i] + at;
            pieces[n].nbytes = left < piece ? left : piece;
            n++;
        }
    }
    for (size_t p = 0; p < n; p++) {
        int64_t start = pieces[p].dst, end = start + pieces[p].nbytes;

        while (lo < p && pieces[lo].src + pieces[lo].nbytes <= start)
            lo++;
        while (hi < p && pieces[hi].src < end)
            hi++;
        pieces[p].wait_lo = lo;
        pieces[p].wait_hi = hi;
        if (!(lo < p && hi == p))  /* it does not wait for piece p - 1 */
            chains[nchains++] = p;
    }
    chains[nchains] = n;
    return nchains;
}

static int inf_move__ready(struct inf_move__job *job, size_t lo, size_t hi)
{
    for (size_t q = hi; q-- > lo;)  /* the latest is the likeliest to be still running */
        if (!atomic_load_explicit(&job->done[q], memory_order_acquire))
            return 0;
    return 1;
}

static void inf_move__wait(struct inf_move__job *job, size_t lo, size_t hi)
{
    for (int spin = 0; spin < INF_MOVE__SPINS; spin++) {
        if (inf_move__ready(job, lo, hi))
            return;
        inf_move__pause();
    }
    pthread_mutex_lock(&job->lock);
    while (!inf_move__ready(job, lo, hi))
        pthread_cond_wait(&job->cond, &job->lock);
    pthread_mutex_unlock(&job->lock);
}

/* Take chains in order until none is left, and copy each chain's pieces in order. Progress is
 * certain: a piece waits only for earlier ones, so the earliest piece not done has all it waits
 * for done, and the thread that took it is not waiting. */
static void inf_move__drain(void *arg)
{
    struct inf_move__job *job = arg;

    for (;;) {
        size_t c = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed);

        if (c >= job->nchains)
            return;
        for (size_t p = job->chains[c]; p < job->chains[c + 1]; p++) {
            const struct inf_move__piece *piece = &job->pieces[p];

            inf_move__wait(job, piece->wait_lo, piece->wait_hi);
            /* acquire above: the sources this target overlaps have been read */
            memmove(job->base + piece->dst, job->base + piece->src, (size_t)piece->nbytes);
            pthread_mutex_lock(&job->lock);
            atomic_store_explicit(&job->done[p], 1, memory_order_release);
            pthread_cond_broadcast(&job->cond);
            pthread_mutex_unlock(&job->lock);
        }
    }
}

/* 0 once every move is done; -errno, with nothing copied, when the job cannot be set up. */
static int inf_move__parallel(uint8_t *base, const int64_t *dst, const int64_t *src,
                              const int64_t *nbytes, size_t count, int threads,
                              struct inf_pool *pool)
{
    struct inf_move__job job = {.base = base};
    size_t npieces = inf_move__count_pieces(dst, src, nbytes, count, threads);
    struct inf_move__piece *pieces = malloc(npieces * sizeof(*pieces));
    size_t *chains = malloc((npieces + 1) * sizeof(*chains));
    int ret = -ENOMEM;

    job.done = calloc(npieces, sizeof(*job.done));
    if (!pieces || !chains || !job.done)
        goto err;
    ret = -pthread_mutex_init(&job.lock, NULL);
    if (ret < 0)
        goto err;
    ret = -pthread_cond_init(&job.cond, NULL);
    if (ret < 0) {
        pthread_mutex_destroy(&job.lock);
        goto err;
    }
    job.nchains = inf_move__cut(pieces, chains, dst, src, nbytes, count, threads);
    job.pieces = pieces;
    job.chains = chains;
    atomic_init(&job.next, 0);
    inf_pool_run(pool, inf_move__drain, &job, threads);
    pthread_cond_destroy(&job.cond);
    pthread_mutex_destroy(&job.lock);
    ret = 0;
err:
    free(job.done);
    free(chains);
    free(pieces);
    return ret;
}

int inf_move_down_batch(uint8_t *base, size_t base_nbytes, const int64_t *dst, const int64_t *src,
                        const int64_t *nbytes, size_t count, int threads, struct inf_pool *pool)
{
    int64_t moved;
    int64_t want = threads < INF_MOVE__MAX_THREADS ? threads : INF_MOVE__MAX_THREADS;
    int ret = inf_move__check(base, base_nbytes, dst, src, nbytes, count, threads, &moved);

    if (ret < 0)
        return ret;
    if (want > moved / INF_MOVE__MIN_PER_THREAD)
        want = moved / INF_MOVE__MIN_PER_THREAD;
    if (want > 1 && pool && inf_move__parallel(base, dst, src, nbytes, count, (int)want, pool) == 0)
        return 0;
    inf_move__sequential(base, dst, src, nbytes, count);  /* also when no job could be set up */
    return 0;
}
