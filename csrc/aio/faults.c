/*
 * The fault table behind inf_aio_fault_add (faults.h).
 *
 * [Note: fault injection costs nothing when off] Every piece submission asks
 * fault_table_match whether a fault applies. With none installed (the production case, and a
 * test's once its faults have fired) that is one atomic load: no lock, no count. Faults are
 * counted from the moment they are installed ("nth from now"), so the pieces submitted while
 * none is armed need no number. A fault leaves the table when its piece comes (it fires, or,
 * when two faults name the same piece, the first one installed fires and the other is
 * dropped).
 */
#include "faults.h"

#include <errno.h>

void fault_table_init(struct fault_table *t)
{
    pthread_mutex_init(&t->lock, NULL);
}

void fault_table_destroy(struct fault_table *t)
{
    pthread_mutex_destroy(&t->lock);
}

int fault_table_add(struct fault_table *t, int op, uint64_t nth, int kind, int64_t value)
{
    int ret = 0;

    pthread_mutex_lock(&t->lock);
    if (t->nfaults == MAX_FAULTS) {
        ret = -ENOSPC;
    } else {
        /* nth counts from now; store it as an absolute submission number */
        uint64_t base = t->seq[op == -1 ? 2 : op];

        t->faults[t->nfaults++] =
            (struct fault){.op = op, .nth = base + nth, .kind = kind, .value = value};
        atomic_store_explicit(&t->armed, t->nfaults, memory_order_release);
    }
    pthread_mutex_unlock(&t->lock);
    return ret;
}

const struct fault *fault_table_match_armed(struct fault_table *t, int op, struct fault *out)
{
    const struct fault *hit = NULL;
    int i, kept = 0;

    /* Counting and matching under one lock, so a fault added meanwhile counts from a number
     * no piece has taken yet. */
    pthread_mutex_lock(&t->lock);
    t->seq[op]++;
    t->seq[2]++;
    for (i = 0; i < t->nfaults; i++) {
        const struct fault *f = &t->faults[i];

        if (f->nth >= t->seq[f->op == -1 ? 2 : f->op]) {
            t->faults[kept++] = *f; /* its piece has not come yet */
        } else if (!hit) {          /* its piece is this one (the counts move by one a call) */
            *out = *f;
            hit = out;
        }                           /* else a second fault on this piece: dropped */
    }
    t->nfaults = kept;
    atomic_store_explicit(&t->armed, kept, memory_order_release);
    pthread_mutex_unlock(&t->lock);
    return hit;
}
