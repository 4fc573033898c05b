/*
 * inf_move: the byte moves of one arena compaction, done in one call on several threads.
 *
 * A compaction slides live ranges of one buffer toward its start, in address order. Move i
 * copies nbytes[i] bytes from base + src[i] to base + dst[i], and the call has the effect of
 * memmove() for i = 0, 1, ..., count - 1 in that order. The moves must have the shape a
 * compaction gives them (checked before anything is copied):
 *     0 <= dst[i] <= src[i],  nbytes[i] >= 0,  src[i] + nbytes[i] <= base_nbytes,
 *     src[i] >= src[i - 1] + nbytes[i - 1],  dst[i] >= dst[i - 1] + nbytes[i - 1].
 * Zero-length moves are allowed (they copy nothing but are checked like the others).
 *
 * [Note: only write-after-read] With that shape a move's target may overlap its own source and
 * the sources of earlier moves (a block slides over where earlier blocks were), never the source
 * of a later move or the target of another move, and no move reads bytes an earlier move wrote.
 * So the only ordering to keep is: a piece of a target is written after every earlier piece
 * whose source it overlaps has been read. Each move is cut into pieces of gap / threads bytes
 * (gap = src - dst; at least 64 KiB, at most 1 MiB), so that pieces of one move that overlaps
 * itself can still be copied side by side. A piece waits (spinning briefly, then sleeping) only
 * for the earlier pieces whose sources its target overlaps; one that overlaps its own source is
 * one memmove. A piece that waits for the piece just before it joins that piece's chain, and
 * threads take whole chains in order. The result is the same for any thread count and timing.
 *
 * Return values: 0 on success, -EINVAL for a bad argument (NULL base or array with count > 0,
 * threads < 1, moves not of the shape above); a failed call copies nothing. Nothing here prints,
 * exits or keeps state; a helper thread or a scratch allocation that fails only means fewer
 * threads (down to the calling one), never an error.
 * Thread safety: reentrant. The call runs on the calling thread plus at most threads - 1 workers
 * of the caller's pool (at most 63, and one per MiB moved, so none below 2 MiB; none when pool
 * is NULL), all done before it returns.
 * No other thread may read or write the source or target ranges during the call.
 */
#ifndef INF_MOVE_H
#define INF_MOVE_H

#include <stddef.h>
#include <stdint.h>

struct inf_pool;  /* csrc/common/inf_pool.h: worker threads owned by the caller */

int inf_move_down_batch(uint8_t *base, size_t base_nbytes, const int64_t *dst, const int64_t *src,
                        const int64_t *nbytes, size_t count, int threads, struct inf_pool *pool);

#endif
