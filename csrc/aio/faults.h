/*
 * Fault injection for tests: a table of faults, each naming the nth piece (read, write or
 * either) from the moment it is installed, matched as pieces are submitted. See
 * [Note: fault injection costs nothing when off] in faults.c.
 */
#ifndef INF_AIO_FAULTS_H
#define INF_AIO_FAULTS_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#define MAX_FAULTS 64

struct fault {
    int op;                        /* INF_AIO_OP_* or -1 for either */
    uint64_t nth;
    int kind;                      /* INF_AIO_FAULT_* */
    int64_t value;
};

struct fault_table {
    pthread_mutex_t lock;
    struct fault faults[MAX_FAULTS]; /* installed, not yet reached; under lock */
    int nfaults;                   /* under lock */
    atomic_int armed;              /* nfaults, read without the lock by every piece submission */
    uint64_t seq[3];               /* submissions counted (while faults are armed): reads, writes,
                                    * both; under lock */
};

void fault_table_init(struct fault_table *t);
void fault_table_destroy(struct fault_table *t);
/* Install a checked fault: -ENOSPC when MAX_FAULTS are installed already. */
int fault_table_add(struct fault_table *t, int op, uint64_t nth, int kind, int64_t value);
const struct fault *fault_table_match_armed(struct fault_table *t, int op, struct fault *out);

/* Count this submission and return the fault that applies to it (copied into *out), if any;
 * with none installed, one atomic load. */
static inline const struct fault *fault_table_match(struct fault_table *t, int op,
                                                    struct fault *out)
{
    if (atomic_load_explicit(&t->armed, memory_order_acquire) == 0)
        return NULL;
    return fault_table_match_armed(t, op, out);
}

#endif
