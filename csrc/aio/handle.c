/*
 * The engine core: requests cut into pieces, per-queue progress threads, completion checking,
 * short-transfer resumption and the injected faults' effects (the fault table: faults.c).
 * Backends only start and reap pieces.
 *
 * Locking: a queue's lock guards its pending list, held list and counters; the handle's
 * req_lock guards every request's progress. Order: queue lock, then req_lock, never the other
 * way round. The fault table's own lock is a leaf (faults.c).
 */
#define _GNU_SOURCE
#include "inf_aio.h"
#include "backend.h"
#include "faults.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct queue {
    struct inf_aio_handle *handle;
    const struct backend_ops *ops;
    struct backend *be;
    pthread_mutex_t lock;
    pthread_cond_t idle_cond;      /* the progress thread sleeps here when nothing is in flight */
    struct piece *pending_head;    /* queued, not yet given to the backend */
    struct piece *pending_tail;
    struct piece *held;            /* injected hangs: never given to the backend */
    uint32_t inflight;             /* given to the backend, not yet reaped */
    int in_backend_wait;           /* the progress thread is in (or about to enter) ops->wait */
    int wake_sent;                 /* a wake-up is on its way; no need for another */
    int stop;
    pthread_t thread;
    int thread_started;
    struct completion *done;       /* depth + 2, for the progress thread */
    struct piece **batch;          /* depth, for the progress thread */
};

struct inf_aio_request {
    struct piece *pieces;          /* one allocation of npieces */
    uint32_t npieces;
    uint32_t remaining;            /* pieces not yet finished; under req_lock */
    int done;                      /* under req_lock */
    struct inf_aio_status status;  /* under req_lock */
    struct inf_aio_target target;
};

struct inf_aio_handle {
    struct inf_aio_config config;
    struct queue *queues;
    uint32_t nqueues_started;
    atomic_uint next_queue;
    atomic_int shut;
    pthread_mutex_t shut_lock;     /* serializes shutdown: every caller returns once it is done */
    pthread_mutex_t req_lock;
    pthread_cond_t req_cond;       /* broadcast whenever a request becomes done */
    struct fault_table faults;     /* injected by tests (inf_aio_fault_add) */
};

/* --- pieces and requests ----------------------------------------------------------------- */

/* Point the piece at what is left of it, at most max_nbytes, and choose its descriptor.
 * See [Note: direct and buffered pieces] in inf_aio.h. */
static void piece_prepare(struct piece *p, const struct inf_aio_target *t, uint64_t max_nbytes)
{
    uint64_t left = p->nbytes - p->done;
    uint64_t da = t->direct_align;

    p->cur_buf = p->buf + p->done;
    p->cur_offset = p->offset + (int64_t)p->done;
    p->cur_nbytes = (uint32_t)(left < max_nbytes ? left : max_nbytes);
    if (t->direct_fd >= 0 && ((uintptr_t)p->cur_buf & (t->mem_align - 1)) == 0 &&
        ((uint64_t)p->cur_offset & (da - 1)) == 0 && (p->cur_nbytes & (da - 1)) == 0)
        p->fd = t->direct_fd;
    else
        p->fd = t->buffered_fd;
}

/* Record the end of a piece (err 0 or a positive errno) in its request. */
static void piece_finish(struct inf_aio_handle *h, struct piece *p, int err)
{
    struct inf_aio_request *r = p->req;

    pthread_mutex_lock(&h->req_lock);
    r->status.nbytes_done += (int64_t)p->done;
    if (err && !r->status.error) {
        r->status.error = err;
        r->status.error_offset = p->offset + (int64_t)p->done;
        r->status.error_nbytes = (int64_t)(p->nbytes - p->done);
    }
    if (--r->remaining == 0) {
        r->done = 1;
        pthread_cond_broadcast(&h->req_cond);
    }
    pthread_mutex_unlock(&h->req_lock);
}

static void pending_push_back(struct queue *q, struct piece *p)
{
    p->next = NULL;
    if (q->pending_tail)
        q->pending_tail->next = p;
    else
        q->pending_head = p;
    q->pending_tail = p;
}

static void pending_push_front(struct queue *q, struct piece *p)
{
    p->next = q->pending_head;
    q->pending_head = p;
    if (!q->pending_tail)
        q->pending_tail = p;
}

static struct piece *pending_pop(struct queue *q)
{
    struct piece *p = q->pending_head;

    q->pending_head = p->next;
    if (!q->pending_head)
        q->pending_tail = NULL;
    return p;
}

/* A backend reported res for piece p: resume it, or finish it. Called with q->lock held. */
static void piece_complete(struct queue *q, struct piece *p, int64_t res)
{
    if (res < 0) {
        piece_finish(q->handle, p, (int)-res);
    } else if (res == 0 || (uint64_t)res > p->cur_nbytes) {
        /* A read of 0 bytes met the end of the file; a write of 0 bytes (or a count larger than
         * asked) cannot be resumed meaningfully. */
        piece_finish(q->handle, p, p->op == INF_AIO_OP_READ && res == 0 ? ENODATA : EIO);
    } else {
        p->done += (uint64_t)res;
        if (p->done < p->nbytes)
            pending_push_front(q, p); /* short transfer: resume where it stopped */
        else
            piece_finish(q->handle, p, 0);
    }
}

/* --- progress thread ---------------------------------------------------------------------- */

static void queue_cancel_waiting(struct queue *q)
{
    struct piece *p;

    while (q->pending_head) {
        p = pending_pop(q);
        piece_finish(q->handle, p, ECANCELED);
    }
    while (q->held) {
        p = q->held;
        q->held = p->next;
        piece_finish(q->handle, p, ECANCELED);
    }
}

/* Hand the backend as many pending pieces as the queue depth allows; returns how many pieces
 * left the pending list (started, failed or held). Called with q->lock held; drops it around
 * the backend call so submitters are not held up by a system call. */
static int queue_submit_pending(struct queue *q, struct piece **batch)
{
    struct inf_aio_handle *h = q->handle;
    uint32_t depth = h->config.queue_depth;
    struct fault f;
    int n = 0, handled = 0, taken, i;

    while (q->pending_head && q->inflight + (uint32_t)n < depth) {
        struct piece *p = pending_pop(q);
        const struct fault *hit = fault_table_match(&h->faults, p->op, &f);
        uint64_t limit = UINT32_MAX;

        if (hit && hit->kind == INF_AIO_FAULT_ERRNO) {
            piece_finish(h, p, (int)hit->value);
            handled++;
            continue;
        }
        if (hit && hit->kind == INF_AIO_FAULT_HANG) {
            p->next = q->held;
            q->held = p;
            handled++;
            continue;
        }
        if (hit && hit->kind == INF_AIO_FAULT_SHORT)
            limit = (uint64_t)hit->value;
        piece_prepare(p, &p->req->target, limit);
        batch[n++] = p;
    }
    if (n == 0)
        return handled;
    /* Only this thread submits and reaps, so the batch and inflight are safe unlocked. */
    pthread_mutex_unlock(&q->lock);
    taken = q->ops->submit(q->be, batch, n);
    pthread_mutex_lock(&q->lock);
    if (taken < 0) {
        if (taken == -EAGAIN && q->inflight > 0) {
            taken = 0; /* out of kernel resources for now: retry after a completion */
        } else {
            for (i = 0; i < n; i++)
                piece_finish(h, batch[i], -taken);
            return handled + n;
        }
    }
    q->inflight += (uint32_t)taken;
    for (i = n - 1; i >= taken; i--)
        pending_push_front(q, batch[i]);
    return handled + taken;
}

static void *queue_progress_main(void *arg)
{
    struct queue *q = arg;
    uint32_t depth = q->handle->config.queue_depth;
    struct completion *done = q->done;
    struct piece **batch = q->batch;
    int n, i;

    pthread_mutex_lock(&q->lock);
    for (;;) {
        if (q->stop) {
            queue_cancel_waiting(q);
            if (q->inflight == 0)
                break;
        } else if (queue_submit_pending(q, batch) > 0) {
            continue; /* more may have been queued while the lock was dropped */
        }
        if (q->inflight == 0) {
            if (!q->pending_head && !q->stop)
                pthread_cond_wait(&q->idle_cond, &q->lock);
            continue;
        }
        q->in_backend_wait = 1;
        pthread_mutex_unlock(&q->lock);
        n = q->ops->wait(q->be, done, (int)depth + 2);
        pthread_mutex_lock(&q->lock);
        q->in_backend_wait = 0;
        if (n < 0) {
            /* EINTR is retried inside the backends; anything else is unexpected, but the pieces
             * in flight still need reaping, so back off and try again. */
            struct timespec pause = {0, 1000000};

            pthread_mutex_unlock(&q->lock);
            nanosleep(&pause, NULL);
            pthread_mutex_lock(&q->lock);
            continue;
        }
        for (i = 0; i < n; i++) {
            if (!done[i].piece) {
                q->wake_sent = 0;
                continue;
            }
            q->inflight--;
            piece_complete(q, done[i].piece, done[i].res);
        }
    }
    pthread_mutex_unlock(&q->lock);
    return NULL;
}

/* Make the progress thread look at its queue again. q->lock held. */
static void queue_kick(struct queue *q)
{
    if (q->in_backend_wait) {
        if (!q->wake_sent) {
            q->wake_sent = 1;
            q->ops->wake(q->be);
        }
    } else {
        pthread_cond_signal(&q->idle_cond);
    }
}

/* --- handle ------------------------------------------------------------------------------- */

static int cond_init_monotonic(pthread_cond_t *cond)
{
    pthread_condattr_t attr;
    int ret;

    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    ret = pthread_cond_init(cond, &attr);
    pthread_condattr_destroy(&attr);
    return -ret;
}

int inf_aio_handle_create(const struct inf_aio_config *config, struct inf_aio_handle **out)
{
    const struct backend_ops *ops = inf_aio_backend_ops(config->backend);
    struct inf_aio_handle *h;
    uint32_t i;
    int ret;

    if (!ops || config->queue_depth == 0 || config->queue_depth > 4096 || config->queues == 0 ||
        config->queues > 64 || config->block_size == 0 || config->block_size % 4096 ||
        config->block_size > (1ULL << 30))
        return -EINVAL;
    h = calloc(1, sizeof(*h));
    if (!h)
        return -ENOMEM;
    h->config = *config;
    pthread_mutex_init(&h->shut_lock, NULL);
    pthread_mutex_init(&h->req_lock, NULL);
    fault_table_init(&h->faults);
    ret = cond_init_monotonic(&h->req_cond);
    if (ret < 0)
        goto err;
    h->queues = calloc(config->queues, sizeof(*h->queues));
    if (!h->queues) {
        ret = -ENOMEM;
        goto err;
    }
    for (i = 0; i < config->queues; i++) {
        struct queue *q = &h->queues[i];

        q->handle = h;
        q->ops = ops;
        pthread_mutex_init(&q->lock, NULL);
        pthread_cond_init(&q->idle_cond, NULL);
        q->done = calloc(config->queue_depth + 2, sizeof(*q->done));
        q->batch = calloc(config->queue_depth, sizeof(*q->batch));
        if (!q->done || !q->batch) {
            ret = -ENOMEM;
            goto err;
        }
        ret = ops->create(config->queue_depth, &q->be);
        if (ret < 0)
            goto err;
        ret = -pthread_create(&q->thread, NULL, queue_progress_main, q);
        if (ret < 0) {
            ops->destroy(q->be);
            goto err;
        }
        q->thread_started = 1;
        h->nqueues_started++;
    }
    *out = h;
    return 0;
err:
    inf_aio_handle_destroy(h);
    return ret;
}

void inf_aio_handle_shutdown(struct inf_aio_handle *h)
{
    uint32_t i;

    pthread_mutex_lock(&h->shut_lock);
    if (atomic_exchange(&h->shut, 1))
        goto out; /* a concurrent caller already stopped everything: we held shut_lock meanwhile */
    for (i = 0; i < h->nqueues_started; i++) {
        struct queue *q = &h->queues[i];

        pthread_mutex_lock(&q->lock);
        q->stop = 1;
        queue_kick(q);
        pthread_mutex_unlock(&q->lock);
    }
    for (i = 0; i < h->nqueues_started; i++) {
        pthread_join(h->queues[i].thread, NULL);
        h->queues[i].thread_started = 0;
    }
out:
    pthread_mutex_unlock(&h->shut_lock);
}

void inf_aio_handle_destroy(struct inf_aio_handle *h)
{
    uint32_t i;

    if (!h)
        return;
    inf_aio_handle_shutdown(h);
    for (i = 0; h->queues && i < h->nqueues_started; i++) {
        h->queues[i].ops->destroy(h->queues[i].be);
        pthread_mutex_destroy(&h->queues[i].lock);
        pthread_cond_destroy(&h->queues[i].idle_cond);
    }
    for (i = 0; h->queues && i < h->config.queues; i++) {
        free(h->queues[i].done);
        free(h->queues[i].batch);
    }
    free(h->queues);
    pthread_mutex_destroy(&h->shut_lock);
    pthread_mutex_destroy(&h->req_lock);
    fault_table_destroy(&h->faults);
    pthread_cond_destroy(&h->req_cond);
    free(h);
}

/* Next cut after pos: pieces never cross the aligned middle's edges nor exceed block_size. */
static int64_t next_cut(int64_t pos, int64_t end, int64_t mid_start, int64_t mid_end, int64_t bs)
{
    int64_t limit = pos < mid_start ? mid_start : pos < mid_end ? mid_end : end;

    return limit - pos > bs ? pos + bs : limit; /* pos + bs may not fit in an int64_t */
}

/* How many cuts next_cut makes in [from, to). */
static uint64_t count_cuts(int64_t from, int64_t to, int64_t bs)
{
    return from < to ? ((uint64_t)(to - from) + (uint64_t)bs - 1) / (uint64_t)bs : 0;
}

/* [Note: preallocating extending writes] O_DIRECT pieces extending a file get blocks in
 * completion order (2-4 extents, out of order, for 22 MiB on ext4), so a write past the end
 * first fallocates its range, which also sets the new size. Best effort: where that fails the
 * pieces report their own errors; a write failing after it leaves the file at its new size. */
static void preallocate_if_extending(const struct inf_aio_target *t, int64_t offset, uint64_t nbytes)
{
    struct stat st;

    if (fstat(t->buffered_fd, &st) == 0 && st.st_size < offset + (int64_t)nbytes)
        (void)fallocate(t->buffered_fd, 0, (off_t)offset, (off_t)nbytes);
}

int inf_aio_submit(struct inf_aio_handle *h, int op, const struct inf_aio_target *target,
                   void *buf, uint64_t nbytes, int64_t offset, struct inf_aio_request **out)
{
    int64_t bs = (int64_t)h->config.block_size, da, end, mid_start, mid_end, mid_bs, pos;
    struct inf_aio_request *r;
    uint32_t n, i, nq = h->config.queues, first;
    uint64_t up, npieces;

    if ((op != INF_AIO_OP_READ && op != INF_AIO_OP_WRITE) || nbytes == 0 || offset < 0 ||
        nbytes > (uint64_t)INT64_MAX - (uint64_t)offset || target->buffered_fd < 0 ||
        target->mem_align == 0 || (target->mem_align & (target->mem_align - 1)) ||
        target->direct_align < 4096 || (target->direct_align & (target->direct_align - 1)))
        return -EINVAL;
    if (atomic_load(&h->shut))
        return -ESHUTDOWN;
    if (op == INF_AIO_OP_WRITE) /* see [Note: preallocating extending writes] */
        preallocate_if_extending(target, offset, nbytes);
    da = target->direct_align;
    end = offset + (int64_t)nbytes;
    up = ((uint64_t)offset + (uint64_t)da - 1) / (uint64_t)da * (uint64_t)da; /* no overflow */
    mid_end = end / da * da;
    if (up >= (uint64_t)mid_end)
        mid_start = mid_end = offset;
    else
        mid_start = (int64_t)up;
    /* Middle pieces are whole multiples of the direct alignment, or every one after the first
     * would be misaligned and go through the page cache. */
    mid_bs = bs >= da ? bs / da * da : da;
    npieces = count_cuts(offset, mid_start, bs) + count_cuts(mid_start, mid_end, mid_bs) +
              count_cuts(mid_end, end, bs);
    if (npieces > UINT32_MAX)
        return -EINVAL;
    n = (uint32_t)npieces;

    r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    r->pieces = calloc(n, sizeof(*r->pieces));
    if (!r->pieces) {
        free(r);
        return -ENOMEM;
    }
    r->npieces = r->remaining = n;
    r->target = *target;
    for (i = 0, pos = offset; i < n; i++) {
        int64_t cut = next_cut(pos, end, mid_start, mid_end, pos >= mid_start && pos < mid_end ? mid_bs : bs);
        struct piece *p = &r->pieces[i];

        p->req = r;
        p->op = op;
        p->buf = (char *)buf + (pos - offset);
        p->offset = pos;
        p->nbytes = (uint64_t)(cut - pos);
        pos = cut;
    }
    *out = r;
    first = atomic_fetch_add(&h->next_queue, 1);
    for (i = 0; i < n && i < nq; i++) {
        struct queue *q = &h->queues[(first + i) % nq];
        uint32_t j;

        pthread_mutex_lock(&q->lock);
        for (j = i; j < n; j += nq) {
            if (q->stop)
                piece_finish(h, &r->pieces[j], ECANCELED);
            else
                pending_push_back(q, &r->pieces[j]);
        }
        queue_kick(q);
        pthread_mutex_unlock(&q->lock);
    }
    return 0;
}

int inf_aio_wait(struct inf_aio_handle *h, struct inf_aio_request *r, int64_t timeout_ns,
                 struct inf_aio_status *status)
{
    struct timespec deadline;
    int ret = 0;

    if (timeout_ns >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &deadline);
        deadline.tv_sec += timeout_ns / 1000000000LL;
        deadline.tv_nsec += timeout_ns % 1000000000LL;
        if (deadline.tv_nsec >= 1000000000L) {
            deadline.tv_sec++;
            deadline.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&h->req_lock);
    while (!r->done && ret == 0) {
        if (timeout_ns < 0)
            pthread_cond_wait(&h->req_cond, &h->req_lock);
        else if (pthread_cond_timedwait(&h->req_cond, &h->req_lock, &deadline) == ETIMEDOUT)
            ret = r->done ? 0 : -ETIMEDOUT;
    }
    if (r->done)
        *status = r->status;
    pthread_mutex_unlock(&h->req_lock);
    return ret;
}

int inf_aio_request_done(struct inf_aio_handle *h, struct inf_aio_request *r)
{
    int done;

    pthread_mutex_lock(&h->req_lock);
    done = r->done;
    pthread_mutex_unlock(&h->req_lock);
    return done;
}

int inf_aio_request_free(struct inf_aio_handle *h, struct inf_aio_request *r)
{
    if (!inf_aio_request_done(h, r))
        return -EBUSY;
    free(r->pieces);
    free(r);
    return 0;
}

int inf_aio_fault_add(struct inf_aio_handle *h, int op, uint64_t nth, int kind, int64_t value)
{
    if (op < -1 || op > INF_AIO_OP_WRITE || kind < INF_AIO_FAULT_ERRNO ||
        kind > INF_AIO_FAULT_HANG || (kind != INF_AIO_FAULT_HANG && value <= 0) ||
        (kind == INF_AIO_FAULT_ERRNO && value > 4095))
        return -EINVAL;
    return fault_table_add(&h->faults, op, nth, kind, value);
}
