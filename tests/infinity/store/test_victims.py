"""The eviction heap picks exactly what a scan of every copy would, in [Note: eviction order]."""

import math
import random

import torch

from infinity.store._common import Tier
from infinity.store._entry import Copy, CopyState, Entry
from infinity.store._victims import VictimQueue


class _Move:
    """Stands in for a PendingMove: only whether it has finished matters here."""

    def __init__(self, finished):
        self.finished = finished

    def done(self):
        return self.finished


def _scan(entries):
    """The reference: the old O(n) scan (ties go to the oldest entry)."""
    best, best_rank = None, None
    for entry in entries:
        copy = entry.copies[Tier.HOST]
        if not copy.evictable:
            continue
        rank = (not copy.prefetched, entry.next_use, copy.moves_done(), -copy.last_use)
        if best_rank is None or rank > best_rank:
            best, best_rank = entry, rank
    return best


def test_heap_choice_matches_a_full_scan_under_random_changes():
    rng = random.Random(0)
    queue = VictimQueue()
    entries = []
    for step in range(4000):
        if not entries or rng.random() < 0.05:
            entry = Entry(f"k{len(entries)}", torch.Size([1]), torch.float32, 4, order=len(entries))
            entry.copies[Tier.HOST] = Copy(Tier.HOST, state=CopyState.VALID)
            entries.append(entry)
            queue.update(entry, entry.copies[Tier.HOST])
        entry = rng.choice(entries)
        copy = entry.copies[Tier.HOST]
        change = rng.randrange(6)
        if change == 0:
            copy.holders = [0] * rng.choice([0, 0, 1])  # uses: one per holder
        elif change == 1:
            copy.pins = rng.choice([0, 0, 0, 1])
        elif change == 2:
            copy.prefetched = rng.random() < 0.3
        elif change == 3:
            entry.next_use = rng.choice([math.inf, rng.randrange(5)])  # few values: many ties
        elif change == 4:
            copy.last_use = rng.randrange(10)
        else:  # a move into or out of it, running or finished, or none
            copy.move = rng.choice([None, _Move(False), _Move(True)])
            copy.state = (rng.choice([CopyState.FILLING, CopyState.DRAINING]) if copy.move
                          else CopyState.VALID)
        queue.update(entry, copy)
        if step % 3 == 0:
            for e in entries:  # as the store does before picking: finished moves are settled
                c = e.copies[Tier.HOST]
                if c.busy and c.moves_done():
                    c.move, c.state = None, CopyState.VALID
                    queue.update(e, c)
            assert queue.pick() is _scan(entries), step
    assert len(queue._heap) <= 4 * len(queue) + 65  # stale items do not pile up


def test_ties_go_to_the_oldest_entry_and_unevictable_copies_never_come_out():
    queue = VictimQueue()
    entries = [Entry(f"k{i}", torch.Size([1]), torch.float32, 4, order=i) for i in range(3)]
    for entry in reversed(entries):
        entry.copies[Tier.HOST] = Copy(Tier.HOST, state=CopyState.VALID)
        queue.update(entry, entry.copies[Tier.HOST])
    assert queue.pick() is entries[0]
    entries[0].copies[Tier.HOST].holders = [0]  # one use
    queue.update(entries[0], entries[0].copies[Tier.HOST])
    entries[1].copies[Tier.HOST].pins = 1
    queue.update(entries[1], entries[1].copies[Tier.HOST])
    assert queue.pick() is entries[2]
    queue.discard(entries[2].copies[Tier.HOST])
    assert queue.pick() is None and len(queue) == 0
