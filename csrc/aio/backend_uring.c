/*
 * io_uring through its system calls (no liburing). One ring per queue, driven only by the
 * queue's progress thread, so completions' task work runs there and never interrupts the
 * caller. Wake-ups: a read of an eventfd stays armed in the ring and completes when another
 * thread writes to it.
 */
#define _GNU_SOURCE
#include "backend.h"
#include "inf_aio.h"

#include <errno.h>
#include <linux/io_uring.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#define WAKE_DATA 0

struct backend {
    int ring_fd;
    int efd;
    uint64_t wake_value;           /* the armed eventfd read lands here */
    unsigned to_submit;            /* entries placed in the SQ, not yet taken by the kernel */
    int wake_armed;                /* armed by the progress thread, so its task work runs there */
    /* submission queue */
    unsigned *sq_head, *sq_tail, *sq_mask, *sq_array;
    unsigned sq_entries;
    struct io_uring_sqe *sqes;
    /* completion queue */
    unsigned *cq_head, *cq_tail, *cq_mask;
    struct io_uring_cqe *cqes;
    /* mappings */
    void *sq_ring, *cq_ring;
    size_t sq_ring_size, cq_ring_size, sqes_size;
};

static int sys_setup(unsigned entries, struct io_uring_params *p)
{
    return (int)syscall(SYS_io_uring_setup, entries, p);
}

static int sys_enter(int fd, unsigned to_submit, unsigned min_complete, unsigned flags)
{
    return (int)syscall(SYS_io_uring_enter, fd, to_submit, min_complete, flags, NULL, 0);
}

static struct io_uring_sqe *sqe_get(struct backend *be)
{
    unsigned tail = *be->sq_tail;
    unsigned head = __atomic_load_n(be->sq_head, __ATOMIC_ACQUIRE);
    struct io_uring_sqe *sqe;

    if (tail - head >= be->sq_entries)
        return NULL;
    sqe = &be->sqes[tail & *be->sq_mask];
    memset(sqe, 0, sizeof(*sqe));
    be->sq_array[tail & *be->sq_mask] = tail & *be->sq_mask;
    return sqe;
}

static void sqe_publish(struct backend *be)
{
    /* release: the kernel must see the filled entry before the new tail */
    __atomic_store_n(be->sq_tail, *be->sq_tail + 1, __ATOMIC_RELEASE);
    be->to_submit++;
}

static void arm_wake(struct backend *be)
{
    struct io_uring_sqe *sqe = sqe_get(be);

    if (!sqe)
        return; /* cannot happen: the ring has room for depth pieces plus this read */
    sqe->opcode = IORING_OP_READ;
    sqe->fd = be->efd;
    sqe->addr = (uint64_t)(uintptr_t)&be->wake_value;
    sqe->len = sizeof(be->wake_value);
    sqe->user_data = WAKE_DATA;
    sqe_publish(be);
}

/* Give the kernel what is in the SQ; the rest is retried by the next call. */
static int flush(struct backend *be, unsigned min_complete, unsigned flags)
{
    int ret = sys_enter(be->ring_fd, be->to_submit, min_complete, flags);

    if (ret < 0)
        return -errno;
    be->to_submit -= (unsigned)ret;
    return 0;
}

static void uring_destroy(struct backend *be)
{
    if (be->sqes && be->sqes != MAP_FAILED)
        munmap(be->sqes, be->sqes_size);
    if (be->cq_ring && be->cq_ring != MAP_FAILED && be->cq_ring != be->sq_ring)
        munmap(be->cq_ring, be->cq_ring_size);
    if (be->sq_ring && be->sq_ring != MAP_FAILED)
        munmap(be->sq_ring, be->sq_ring_size);
    if (be->ring_fd >= 0)
        close(be->ring_fd);
    if (be->efd >= 0)
        close(be->efd);
    free(be);
}

static int uring_create(uint32_t depth, struct backend **out)
{
    struct backend *be = calloc(1, sizeof(*be));
    struct io_uring_params p;
    int ret;

    if (!be)
        return -ENOMEM;
    be->ring_fd = be->efd = -1;
    memset(&p, 0, sizeof(p));
    be->ring_fd = sys_setup(depth + 1, &p);
    if (be->ring_fd < 0) {
        ret = -errno;
        goto err;
    }
    /* IORING_OP_READ / IORING_OP_WRITE came in 5.6 with IORING_FEAT_RW_CUR_POS; 5.4 and 5.5
     * have SINGLE_MMAP but fail every piece (and the wake-up read) with EINVAL. */
    if (!(p.features & IORING_FEAT_SINGLE_MMAP) || !(p.features & IORING_FEAT_RW_CUR_POS)) {
        ret = -EOPNOTSUPP; /* kernels before 5.6: kernel AIO serves them */
        goto err;
    }
    be->sq_ring_size = p.sq_off.array + p.sq_entries * sizeof(unsigned);
    be->cq_ring_size = p.cq_off.cqes + p.cq_entries * sizeof(struct io_uring_cqe);
    if (be->cq_ring_size > be->sq_ring_size)
        be->sq_ring_size = be->cq_ring_size;
    be->sq_ring = mmap(NULL, be->sq_ring_size, PROT_READ | PROT_WRITE,
                       MAP_SHARED | MAP_POPULATE, be->ring_fd, IORING_OFF_SQ_RING);
    if (be->sq_ring == MAP_FAILED) {
        ret = -errno;
        goto err;
    }
    be->cq_ring = be->sq_ring;
    be->sqes_size = p.sq_entries * sizeof(struct io_uring_sqe);
    be->sqes = mmap(NULL, be->sqes_size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE,
                    be->ring_fd, IORING_OFF_SQES);
    if (be->sqes == MAP_FAILED) {
        ret = -errno;
        goto err;
    }
    be->sq_head = (unsigned *)((char *)be->sq_ring + p.sq_off.head);
    be->sq_tail = (unsigned *)((char *)be->sq_ring + p.sq_off.tail);
    be->sq_mask = (unsigned *)((char *)be->sq_ring + p.sq_off.ring_mask);
    be->sq_array = (unsigned *)((char *)be->sq_ring + p.sq_off.array);
    be->sq_entries = p.sq_entries;
    be->cq_head = (unsigned *)((char *)be->cq_ring + p.cq_off.head);
    be->cq_tail = (unsigned *)((char *)be->cq_ring + p.cq_off.tail);
    be->cq_mask = (unsigned *)((char *)be->cq_ring + p.cq_off.ring_mask);
    be->cqes = (struct io_uring_cqe *)((char *)be->cq_ring + p.cq_off.cqes);
    be->efd = eventfd(0, EFD_CLOEXEC);
    if (be->efd < 0) {
        ret = -errno;
        goto err;
    }
    *out = be;
    return 0;
err:
    uring_destroy(be);
    return ret;
}

static int uring_submit(struct backend *be, struct piece **pieces, int n)
{
    int i, ret;

    for (i = 0; i < n; i++) {
        struct io_uring_sqe *sqe = sqe_get(be);
        struct piece *pc = pieces[i];

        if (!sqe)
            break;
        sqe->opcode = pc->op == INF_AIO_OP_READ ? IORING_OP_READ : IORING_OP_WRITE;
        sqe->fd = pc->fd;
        sqe->addr = (uint64_t)(uintptr_t)pc->cur_buf;
        sqe->len = pc->cur_nbytes;
        sqe->off = (uint64_t)pc->cur_offset;
        sqe->user_data = (uint64_t)(uintptr_t)pc;
        sqe_publish(be);
    }
    ret = flush(be, 0, 0);
    if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
        /* A hard failure took none of them: take them back out of the SQ (nothing but this
         * thread writes it, and without SQPOLL the kernel reads it only in io_uring_enter). */
        __atomic_store_n(be->sq_tail, *be->sq_tail - (unsigned)i, __ATOMIC_RELEASE);
        be->to_submit -= (unsigned)i;
        return ret;
    }
    return i; /* entries left in the SQ by a busy kernel go with the next flush */
}

static int uring_wait(struct backend *be, struct completion *out, int max)
{
    int n, ret;

    if (!be->wake_armed) {
        arm_wake(be);
        be->wake_armed = 1;
    }
    for (;;) {
        unsigned head = *be->cq_head;
        unsigned tail = __atomic_load_n(be->cq_tail, __ATOMIC_ACQUIRE);

        for (n = 0; head != tail && n < max; head++) {
            struct io_uring_cqe *cqe = &be->cqes[head & *be->cq_mask];

            if (cqe->user_data == WAKE_DATA) {
                arm_wake(be);
                out[n++] = (struct completion){.piece = NULL, .res = 0};
            } else {
                out[n++] = (struct completion){
                    .piece = (struct piece *)(uintptr_t)cqe->user_data, .res = cqe->res};
            }
        }
        __atomic_store_n(be->cq_head, head, __ATOMIC_RELEASE);
        if (n > 0) {
            if (be->to_submit)
                flush(be, 0, 0);
            return n;
        }
        ret = flush(be, 1, IORING_ENTER_GETEVENTS);
        if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY)
            return ret;
    }
}

static int uring_wake(struct backend *be)
{
    uint64_t one = 1;

    return write(be->efd, &one, sizeof(one)) == sizeof(one) ? 0 : -errno;
}

const struct backend_ops inf_aio_uring_ops = {
    .name = "io_uring",
    .create = uring_create,
    .destroy = uring_destroy,
    .submit = uring_submit,
    .wait = uring_wait,
    .wake = uring_wake,
};
