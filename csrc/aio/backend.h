/*
 * Internal: the interface each engine implements, and the piece the core hands it.
 * A backend is driven by exactly one progress thread (submit and wait), except wake, which any
 * thread may call to make a blocked wait return.
 */
#ifndef INF_AIO_BACKEND_H
#define INF_AIO_BACKEND_H

#include <stdint.h>

struct inf_aio_request;

/* One piece of a request; resumed in place after a short transfer. */
struct piece {
    struct piece *next;            /* link in its queue's pending or held list */
    struct inf_aio_request *req;
    char *buf;                     /* start of the whole piece */
    uint64_t nbytes;               /* size of the whole piece */
    int64_t offset;                /* file offset of the whole piece */
    uint64_t done;                 /* bytes already moved */
    int op;                        /* INF_AIO_OP_* */
    /* What the backend must do now (set by the core before each submission). */
    int fd;
    char *cur_buf;
    uint32_t cur_nbytes;
    int64_t cur_offset;
};

struct completion {
    struct piece *piece;           /* NULL for a wake-up */
    int64_t res;                   /* bytes moved, or -errno */
};

struct backend;

struct backend_ops {
    const char *name;
    int (*create)(uint32_t depth, struct backend **out);
    void (*destroy)(struct backend *be);
    /* Start up to n pieces; returns how many were taken (the rest stay with the caller) or
     * -errno when none could be. At most `depth` pieces are ever in flight. */
    int (*submit)(struct backend *be, struct piece **pieces, int n);
    /* Block until at least one completion or a wake-up; fills out[0..max) and returns the
     * count (wake-ups appear as piece == NULL), or -errno. */
    int (*wait)(struct backend *be, struct completion *out, int max);
    /* Make a blocked or the next wait return; callable from any thread. */
    int (*wake)(struct backend *be);
};

/* The ops of an INF_AIO_BACKEND_* id, or NULL (environment.c). */
const struct backend_ops *inf_aio_backend_ops(int backend);

extern const struct backend_ops inf_aio_kaio_ops;
extern const struct backend_ops inf_aio_uring_ops;
extern const struct backend_ops inf_aio_threads_ops;

#endif /* INF_AIO_BACKEND_H */
