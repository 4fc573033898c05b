/*
 * inf_pool: a persistent pool of worker threads that join the calling thread on one job.
 *
 * A kernel that spreads one array over threads (Adam, compaction moves) used to create and join
 * its threads on every call: about 40 us a call on a 2-vCPU VM, as much as updating 100k
 * elements. A per-unit optimizer step makes thousands of such calls a step, so the threads are
 * made once, by the caller, and handed to each call (as liburing's caller owns its ring).
 *
 * inf_pool_run(pool, fn, arg, want) calls fn(arg) on the calling thread and on up to want - 1
 * workers at once, and returns when every call that started has returned. fn must be a "drain":
 * it takes work items from a shared queue in arg until none are left, so that the job is done
 * whoever joins. Workers that wake after the calling thread has drained the queue do not join.
 *
 * Return values: 0 on success, -errno on failure (-EINVAL for threads < 1, -ENOMEM, or the
 * error of pthread_create; a partly started pool is undone). Nothing here prints or exits.
 * Thread safety: inf_pool_run may be called from several threads at once; runs on one pool take
 * turns (a second caller waits for the first run to end). inf_pool_destroy must not race a run.
 *
 * [Note: one pool, two modules] The pool's code is compiled into each native module that uses
 * it (infinity.memory and infinity.optim), from this one source; a pool created by one module
 * may be run by the other because the struct and the code are the same.
 */
#ifndef INF_POOL_H
#define INF_POOL_H

struct inf_pool;

int inf_pool_create(int threads, struct inf_pool **out);
void inf_pool_destroy(struct inf_pool *pool);
void inf_pool_run(struct inf_pool *pool, void (*fn)(void *), void *arg, int want);

#endif /* INF_POOL_H */
