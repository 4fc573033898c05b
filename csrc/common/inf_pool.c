/* Persistent worker threads; see inf_pool.h. */
#include "inf_pool.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>

struct inf_pool {
    pthread_mutex_t run_lock;   /* one run at a time */
    pthread_mutex_t lock;       /* guards every field below */
    pthread_cond_t wake;        /* workers sleep here between runs */
    pthread_cond_t settled;     /* the runner sleeps here until joined workers return */
    void (*fn)(void *);
    void *arg;
    unsigned long generation;   /* bumped by each run */
    int open;                   /* workers that may still join the current run */
    int busy;                   /* workers inside fn */
    int stop;
    int nworkers;               /* threads - 1 */
    pthread_t workers[];
};

static void *inf_pool__worker(void *p)
{
    struct inf_pool *pool = p;
    unsigned long seen = 0;

    pthread_mutex_lock(&pool->lock);
    for (;;) {
        while (!pool->stop && (pool->generation == seen || pool->open == 0))
            pthread_cond_wait(&pool->wake, &pool->lock);
        if (pool->stop)
            break;
        seen = pool->generation;
        pool->open--;
        pool->busy++;
        pthread_mutex_unlock(&pool->lock);
        pool->fn(pool->arg);
        pthread_mutex_lock(&pool->lock);
        if (--pool->busy == 0)
            pthread_cond_signal(&pool->settled);
    }
    pthread_mutex_unlock(&pool->lock);
    return NULL;
}

static void inf_pool__stop(struct inf_pool *pool, int started)
{
    pthread_mutex_lock(&pool->lock);
    pool->stop = 1;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);
    for (int t = 0; t < started; t++)
        pthread_join(pool->workers[t], NULL);
    pthread_cond_destroy(&pool->settled);
    pthread_cond_destroy(&pool->wake);
    pthread_mutex_destroy(&pool->lock);
    pthread_mutex_destroy(&pool->run_lock);
    free(pool);
}

int inf_pool_create(int threads, struct inf_pool **out)
{
    struct inf_pool *pool;
    int started = 0, ret;

    if (threads < 1 || !out)
        return -EINVAL;
    pool = calloc(1, sizeof(*pool) + (size_t)(threads - 1) * sizeof(pthread_t));
    if (!pool)
        return -ENOMEM;
    pthread_mutex_init(&pool->run_lock, NULL);
    pthread_mutex_init(&pool->lock, NULL);
    pthread_cond_init(&pool->wake, NULL);
    pthread_cond_init(&pool->settled, NULL);
    pool->nworkers = threads - 1;
    for (; started < pool->nworkers; started++) {
        ret = -pthread_create(&pool->workers[started], NULL, inf_pool__worker, pool);
        if (ret < 0)
            goto err;
    }
    *out = pool;
    return 0;
err:
    inf_pool__stop(pool, started);
    return ret;
}

void inf_pool_destroy(struct inf_pool *pool)
{
    if (pool)
        inf_pool__stop(pool, pool->nworkers);
}

void inf_pool_run(struct inf_pool *pool, void (*fn)(void *), void *arg, int want)
{
    int helpers = want - 1 < pool->nworkers ? want - 1 : pool->nworkers;

    if (helpers < 1) {
        fn(arg);
        return;
    }
    pthread_mutex_lock(&pool->run_lock);
    pthread_mutex_lock(&pool->lock);
    pool->fn = fn;
    pool->arg = arg;
    pool->open = helpers;
    pool->generation++;
    pthread_cond_broadcast(&pool->wake);
    pthread_mutex_unlock(&pool->lock);

    fn(arg);

    pthread_mutex_lock(&pool->lock);
    pool->open = 0;  /* the queue is drained: late workers stay asleep */
    while (pool->busy > 0)
        pthread_cond_wait(&pool->settled, &pool->lock);
    pthread_mutex_unlock(&pool->lock);
    pthread_mutex_unlock(&pool->run_lock);
}
