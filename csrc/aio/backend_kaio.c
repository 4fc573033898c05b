/*
 * Kernel AIO through the io_setup / io_submit / io_getevents system calls (no libaio).
 * Wake-ups: an IOCB_CMD_POLL on an eventfd completes when another thread writes to it.
 * A piece the kernel refuses at submission (e.g. EINVAL) is reported by the next wait, so the
 * core sees every outcome as a completion.
 */
#define _GNU_SOURCE
#include "backend.h"
#include "inf_aio.h"

#include <errno.h>
#include <linux/aio_abi.h>
#include <poll.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define WAKE_DATA 0

struct backend {
    aio_context_t ctx;
    int efd;
    uint32_t depth;
    struct iocb *cbs;              /* depth control blocks, reused (the kernel copies them) */
    struct iocb **cb_ptrs;
    struct io_event *events;       /* depth + 1 */
    struct iocb wake_cb;
    int wake_armed;                /* the eventfd poll is in the kernel; re-armed by wait */
    struct completion refused;     /* a piece io_submit refused, reported by the next wait */
    int has_refused;
};

static long sys_io_setup(unsigned n, aio_context_t *ctx) { return syscall(SYS_io_setup, n, ctx); }
static long sys_io_destroy(aio_context_t ctx) { return syscall(SYS_io_destroy, ctx); }
static long sys_io_submit(aio_context_t ctx, long n, struct iocb **cbs)
{
    return syscall(SYS_io_submit, ctx, n, cbs);
}
static long sys_io_getevents(aio_context_t ctx, long min_nr, long nr, struct io_event *ev)
{
    return syscall(SYS_io_getevents, ctx, min_nr, nr, ev, NULL);
}

static int arm_wake(struct backend *be)
{
    struct iocb *cb = &be->wake_cb;

    memset(cb, 0, sizeof(*cb));
    cb->aio_lio_opcode = IOCB_CMD_POLL;
    cb->aio_fildes = (uint32_t)be->efd;
    cb->aio_buf = POLLIN;
    cb->aio_data = WAKE_DATA;
    if (sys_io_submit(be->ctx, 1, &cb) != 1)
        return -errno;
    be->wake_armed = 1;
    return 0;
}

static void kaio_destroy(struct backend *be)
{
    if (be->ctx)
        sys_io_destroy(be->ctx);
    if (be->efd >= 0)
        close(be->efd);
    free(be->cbs);
    free(be->cb_ptrs);
    free(be->events);
    free(be);
}

static int kaio_create(uint32_t depth, struct backend **out)
{
    struct backend *be = calloc(1, sizeof(*be));
    uint32_t i;
    int ret;

    if (!be)
        return -ENOMEM;
    be->efd = -1;
    be->depth = depth;
    be->cbs = calloc(depth, sizeof(*be->cbs));
    be->cb_ptrs = calloc(depth, sizeof(*be->cb_ptrs));
    be->events = calloc(depth + 1, sizeof(*be->events));
    if (!be->cbs || !be->cb_ptrs || !be->events) {
        ret = -ENOMEM;
        goto err;
    }
    for (i = 0; i < depth; i++)
        be->cb_ptrs[i] = &be->cbs[i];
    if (sys_io_setup(depth + 1, &be->ctx) < 0) {
        ret = -errno;
        be->ctx = 0;
        goto err;
    }
    be->efd = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (be->efd < 0) {
        ret = -errno;
        goto err;
    }
    ret = arm_wake(be);
    if (ret < 0)
        goto err;
    *out = be;
    return 0;
err:
    kaio_destroy(be);
    return ret;
}

static int kaio_submit(struct backend *be, struct piece **pieces, int n)
{
    long ret;
    int i;

    if (be->has_refused)
        return 0; /* report the refused piece first; the core retries the rest after */
    for (i = 0; i < n; i++) {
        struct iocb *cb = &be->cbs[i];
        struct piece *p = pieces[i];

        memset(cb, 0, sizeof(*cb));
        cb->aio_lio_opcode = p->op == INF_AIO_OP_READ ? IOCB_CMD_PREAD : IOCB_CMD_PWRITE;
        cb->aio_fildes = (uint32_t)p->fd;
        cb->aio_buf = (uint64_t)(uintptr_t)p->cur_buf;
        cb->aio_nbytes = p->cur_nbytes;
        cb->aio_offset = p->cur_offset;
        cb->aio_data = (uint64_t)(uintptr_t)p;
    }
    do {
        ret = sys_io_submit(be->ctx, n, be->cb_ptrs);
    } while (ret < 0 && errno == EINTR);
    if (ret >= 0)
        return (int)ret;
    if (errno == EAGAIN)
        return -EAGAIN;
    /* The first control block was refused: it completes now, with that error. */
    be->refused = (struct completion){.piece = pieces[0], .res = -errno};
    be->has_refused = 1;
    return 1;
}

static int kaio_wait(struct backend *be, struct completion *out, int max)
{
    long got, i;
    int n = 0;
    uint64_t drained;

    if (be->has_refused) {
        be->has_refused = 0;
        out[0] = be->refused;
        return 1;
    }
    if (max > (int)be->depth + 1)
        max = (int)be->depth + 1;
    if (!be->wake_armed)
        arm_wake(be); /* a failed re-arm only delays wake-ups: pieces in flight still complete */
    do {
        got = sys_io_getevents(be->ctx, 1, max, be->events);
    } while (got < 0 && errno == EINTR);
    if (got < 0)
        return -errno;
    for (i = 0; i < got; i++) {
        struct io_event *ev = &be->events[i];

        if (ev->data == WAKE_DATA) {
            while (read(be->efd, &drained, sizeof(drained)) > 0)
                ;
            be->wake_armed = 0;
            arm_wake(be);
            out[n++] = (struct completion){.piece = NULL, .res = 0};
        } else {
            out[n++] = (struct completion){.piece = (struct piece *)(uintptr_t)ev->data,
                                           .res = ev->res};
        }
    }
    return n;
}

static int kaio_wake(struct backend *be)
{
    uint64_t one = 1;

    return write(be->efd, &one, sizeof(one)) == sizeof(one) ? 0 : -errno;
}

const struct backend_ops inf_aio_kaio_ops = {
    .name = "libaio",
    .create = kaio_create,
    .destroy = kaio_destroy,
    .submit = kaio_submit,
    .wait = kaio_wait,
    .wake = kaio_wake,
};
