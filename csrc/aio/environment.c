/*
 * What this machine offers: which engines can run here, and the file system's direct-I/O
 * alignment. Nothing here holds state.
 */
#define _GNU_SOURCE
#include "backend.h"
#include "inf_aio.h"

#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <sys/stat.h>

const struct backend_ops *inf_aio_backend_ops(int backend)
{
    switch (backend) {
    case INF_AIO_BACKEND_KAIO: return &inf_aio_kaio_ops;
    case INF_AIO_BACKEND_URING: return &inf_aio_uring_ops;
    case INF_AIO_BACKEND_THREADS: return &inf_aio_threads_ops;
    default: return NULL;
    }
}

int inf_aio_backend_probe(int backend)
{
    const struct backend_ops *ops = inf_aio_backend_ops(backend);
    struct backend *be;
    int ret;

    if (!ops)
        return -EINVAL;
    ret = ops->create(1, &be);
    if (ret < 0)
        return ret;
    ops->destroy(be);
    return 0;
}

int inf_aio_dio_alignment(int fd, uint32_t *mem_align, uint32_t *offset_align)
{
#ifdef STATX_DIOALIGN
    struct statx sx;

    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &sx) == 0 && (sx.stx_mask & STATX_DIOALIGN) &&
        sx.stx_dio_offset_align) {
        *mem_align = sx.stx_dio_mem_align;
        *offset_align = sx.stx_dio_offset_align;
        return 0;
    }
#endif
    (void)fd;
    (void)mem_align;
    (void)offset_align;
    return -EOPNOTSUPP;
}
