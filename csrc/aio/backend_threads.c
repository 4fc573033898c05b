/*
 * Portable engine: `depth` worker threads doing pread / pwrite. The fallback where the kernel
 * interfaces are missing or forbidden, and a reference for the others in tests.
 */
#define _GNU_SOURCE
#include "backend.h"
#include "inf_aio.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

struct backend {
    pthread_mutex_t lock;
    pthread_cond_t work_cond;      /* workers wait here for pieces */
    pthread_cond_t done_cond;      /* the progress thread waits here for completions */
    struct piece **work;           /* ring of depth */
    uint32_t work_head, work_count;
    struct completion *done;       /* depth entries */
    uint32_t done_count;
    uint32_t depth;
    int woken;
    int stop;
    pthread_t *threads;
    uint32_t nthreads;
};

static int64_t transfer(const struct piece *p)
{
    ssize_t ret;

    do {
        if (p->op == INF_AIO_OP_READ)
            ret = pread(p->fd, p->cur_buf, p->cur_nbytes, p->cur_offset);
        else
            ret = pwrite(p->fd, p->cur_buf, p->cur_nbytes, p->cur_offset);
    } while (ret < 0 && errno == EINTR);
    return ret < 0 ? -errno : ret;
}

static void *worker_main(void *arg)
{
    struct backend *be = arg;
    struct piece *p;
    int64_t res;

    pthread_mutex_lock(&be->lock);
    for (;;) {
        while (!be->stop && be->work_count == 0)
            pthread_cond_wait(&be->work_cond, &be->lock);
        if (be->stop)
            break;
        p = be->work[be->work_head];
        be->work_head = (be->work_head + 1) % be->depth;
        be->work_count--;
        pthread_mutex_unlock(&be->lock);
        res = transfer(p);
        pthread_mutex_lock(&be->lock);
        be->done[be->done_count++] = (struct completion){.piece = p, .res = res};
        pthread_cond_signal(&be->done_cond);
    }
    pthread_mutex_unlock(&be->lock);
    return NULL;
}

static void threads_destroy(struct backend *be)
{
    uint32_t i;

    pthread_mutex_lock(&be->lock);
    be->stop = 1;
    pthread_cond_broadcast(&be->work_cond);
    pthread_mutex_unlock(&be->lock);
    for (i = 0; i < be->nthreads; i++)
        pthread_join(be->threads[i], NULL);
    pthread_mutex_destroy(&be->lock);
    pthread_cond_destroy(&be->work_cond);
    pthread_cond_destroy(&be->done_cond);
    free(be->threads);
    free(be->work);
    free(be->done);
    free(be);
}

static int threads_create(uint32_t depth, struct backend **out)
{
    struct backend *be = calloc(1, sizeof(*be));
    int ret = 0;

    if (!be)
        return -ENOMEM;
    pthread_mutex_init(&be->lock, NULL);
    pthread_cond_init(&be->work_cond, NULL);
    pthread_cond_init(&be->done_cond, NULL);
    be->depth = depth;
    be->work = calloc(depth, sizeof(*be->work));
    be->done = calloc(depth, sizeof(*be->done));
    be->threads = calloc(depth, sizeof(*be->threads));
    if (!be->work || !be->done || !be->threads) {
        ret = -ENOMEM;
        goto err;
    }
    for (be->nthreads = 0; be->nthreads < depth; be->nthreads++) {
        ret = -pthread_create(&be->threads[be->nthreads], NULL, worker_main, be);
        if (ret < 0)
            goto err;
    }
    *out = be;
    return 0;
err:
    threads_destroy(be);
    return ret;
}

static int threads_submit(struct backend *be, struct piece **pieces, int n)
{
    int i;

    pthread_mutex_lock(&be->lock);
    for (i = 0; i < n; i++) /* the core keeps at most depth pieces in flight */
        be->work[(be->work_head + be->work_count++) % be->depth] = pieces[i];
    if (n == 1)
        pthread_cond_signal(&be->work_cond);
    else
        pthread_cond_broadcast(&be->work_cond);
    pthread_mutex_unlock(&be->lock);
    return n;
}

static int threads_wait(struct backend *be, struct completion *out, int max)
{
    int n;

    pthread_mutex_lock(&be->lock);
    while (be->done_count == 0 && !be->woken)
        pthread_cond_wait(&be->done_cond, &be->lock);
    n = (int)be->done_count < max ? (int)be->done_count : max;
    memcpy(out, be->done, (size_t)n * sizeof(*out));
    be->done_count -= (uint32_t)n;
    memmove(be->done, be->done + n, be->done_count * sizeof(*out));
    if (be->woken && n < max) {
        be->woken = 0;
        out[n++] = (struct completion){.piece = NULL, .res = 0};
    }
    pthread_mutex_unlock(&be->lock);
    return n;
}

static int threads_wake(struct backend *be)
{
    pthread_mutex_lock(&be->lock);
    be->woken = 1;
    pthread_cond_signal(&be->done_cond);
    pthread_mutex_unlock(&be->lock);
    return 0;
}

const struct backend_ops inf_aio_threads_ops = {
    .name = "threads",
    .create = threads_create,
    .destroy = threads_destroy,
    .submit = threads_submit,
    .wait = threads_wait,
    .wake = threads_wake,
};
