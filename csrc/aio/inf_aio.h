/*
 * inf_aio: asynchronous file I/O for large buffers, over kernel AIO, io_uring or a thread pool.
 *
 * A handle owns `queues` submission queues; each queue has one backend context (an io context, a
 * ring, or `queue_depth` worker threads) and one progress thread that submits and reaps without
 * the caller. A request is one buffer <-> file range; it is cut into pieces of at most
 * `block_size` bytes spread over the queues, so many requests are in flight at once.
 *
 * Every completion is checked: a short transfer is resumed from where it stopped, an error is
 * kept with the file offset and length of the piece that failed, and a read that meets the end
 * of the file fails with ENODATA. A request is done only when none of its pieces is in flight,
 * so its buffer may be reused as soon as inf_aio_wait returns 0.
 *
 * [Note: direct and buffered pieces] A piece goes through the O_DIRECT descriptor only when its
 * buffer address is a multiple of mem_align and its file offset and length are multiples of
 * direct_align (the file system's alignment, at least the page size). Everything else goes
 * through the buffered descriptor, so a tail is never written short with O_DIRECT and a page is
 * never shared by a direct and a buffered writer of the same request.
 *
 * Return values: 0 or a count on success, -errno on failure. Nothing here prints or exits.
 * Thread safety: every function may be called concurrently on one handle from any thread, except
 * inf_aio_handle_destroy, which must be the last call on it.
 */
#ifndef INF_AIO_H
#define INF_AIO_H

#include <stdint.h>

#define INF_AIO_BACKEND_KAIO 1
#define INF_AIO_BACKEND_URING 2
#define INF_AIO_BACKEND_THREADS 3

#define INF_AIO_OP_READ 0
#define INF_AIO_OP_WRITE 1

#define INF_AIO_FAULT_ERRNO 1
#define INF_AIO_FAULT_SHORT 2
#define INF_AIO_FAULT_HANG 3

struct inf_aio_handle;
struct inf_aio_request;

struct inf_aio_config {
    int backend;           /* INF_AIO_BACKEND_* */
    uint64_t block_size;   /* bytes per piece, a multiple of 4096, at most 1 GiB */
    uint32_t queue_depth;  /* pieces in flight per queue */
    uint32_t queues;       /* queues, each with its own progress thread */
};

/* One open file as the engine sees it; the caller opens and closes the descriptors. */
struct inf_aio_target {
    int direct_fd;         /* opened with O_DIRECT, or -1 */
    int buffered_fd;       /* always valid */
    uint32_t mem_align;    /* O_DIRECT buffer address alignment, a power of two */
    uint32_t direct_align; /* O_DIRECT offset and length alignment, a power of two >= 4096 */
};

/* What a finished request did. */
struct inf_aio_status {
    int64_t nbytes_done;   /* bytes transferred by all pieces together */
    int error;             /* 0, or the positive errno of the first piece that failed */
    int64_t error_offset;  /* file offset where that piece stood when it failed */
    int64_t error_nbytes;  /* bytes that piece still had to move */
};

/* Is this backend usable in this process (system calls allowed)? 0 or -errno. */
int inf_aio_backend_probe(int backend);

int inf_aio_handle_create(const struct inf_aio_config *config, struct inf_aio_handle **out);
/* Fails queued and held pieces with ECANCELED, waits for pieces in flight and stops the
 * threads: afterwards every request is done and may be freed; new submissions get -ESHUTDOWN. */
void inf_aio_handle_shutdown(struct inf_aio_handle *handle);
/* Shuts down if needed and frees the handle; free its requests first. */
void inf_aio_handle_destroy(struct inf_aio_handle *handle);

/* Queue a transfer of nbytes > 0 between buf and the target at offset; *out receives the
 * request, which the caller must inf_aio_request_free once it is done. The buffer and
 * descriptors must stay valid until then. A write reaching past the end of the file first
 * preallocates its range (see [Note: preallocating extending writes] in handle.c). */
int inf_aio_submit(struct inf_aio_handle *handle, int op, const struct inf_aio_target *target,
                   void *buf, uint64_t nbytes, int64_t offset, struct inf_aio_request **out);

/* Wait until the request is done or timeout_ns passes (negative: no limit). 0 when done,
 * with *status filled; -ETIMEDOUT otherwise. */
int inf_aio_wait(struct inf_aio_handle *handle, struct inf_aio_request *request,
                 int64_t timeout_ns, struct inf_aio_status *status);

/* 1 when done, 0 while pieces are queued, in flight or held by an injected hang. */
int inf_aio_request_done(struct inf_aio_handle *handle, struct inf_aio_request *request);

/* Free a done request (-EBUSY if it is not done). */
int inf_aio_request_free(struct inf_aio_handle *handle, struct inf_aio_request *request);

/* Fault injection for tests: the nth piece submission from now (0 is the next one; reads and
 * writes counted apart, or together when op is -1) fails with errno
 * `value` (INF_AIO_FAULT_ERRNO), transfers at most `value` bytes (INF_AIO_FAULT_SHORT), or is
 * held and never completes until the handle is destroyed (INF_AIO_FAULT_HANG). At most 64 wait
 * at once (-ENOSPC); one leaves when its piece comes. With none waiting, submissions skip the
 * fault check's lock: see [Note: fault injection costs nothing when off] in faults.c. */
int inf_aio_fault_add(struct inf_aio_handle *handle, int op, uint64_t nth, int kind,
                      int64_t value);

/* Direct-I/O alignment of an open file from statx (STATX_DIOALIGN); 0 when known, else
 * -EOPNOTSUPP and the caller picks a default. */
int inf_aio_dio_alignment(int fd, uint32_t *mem_align, uint32_t *offset_align);

#endif /* INF_AIO_H */
