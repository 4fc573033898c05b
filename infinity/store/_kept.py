"""Kept versions: an entry's bytes held as they were until the caller commits or rolls back.

[Note: kept versions] `TensorStore.keep(key)` holds the entry's current bytes, as its home tier
has them, until `commit(key)` (they are let go) or `rollback(key)` (they are the entry's value
again, and whatever was written since is dropped). Meanwhile the entry is used as any other:
fetched, changed, released dirty, written back, evicted. A caller that may have to undo a
change (a speculative optimizer step, issue 22) keeps what it is about to change.
- NVMe home: copy-on-write of the home copy's extent. keep reserves a fresh extent (the shadow)
  and copies nothing; the home copy's first write-back after it goes to the shadow (`Kept.
  redirect`, at the start of the write, once every earlier move of that copy is settled), so
  the kept extent is never written and that write runs asynchronously as every write-back does.
  commit frees the kept extent (or the unused shadow); rollback frees the copies written since
  and makes the kept extent the entry's NVMe copy again. Neither does I/O.
- A memory home (host, device): keep copies the home block into a new block on that tier (a
  memcpy; the block is nobody's copy: never evicted, counted as staying when a tier looks for
  room); rollback makes that block the entry's copy again.
keep waits (without the lock) for a write-back into the home copy still running and raises its
error: what it keeps is the current value, never a stale one. A write-back that fails after
keep leaves the kept bytes as they were, so a rollback gives them back exactly; a commit then
leaves the entry as any failed write-back does (the faster copy kept, `unsaved`, rewritten
on eviction or by the caller). BudgetError where the home tier has no room for the second
copy (nothing kept); ValueError to keep a kept entry or to commit or roll back one that is not
kept (a second commit), or to roll back one in use or pinned on any tier. `drop` lets a kept
version go with the entry; `close` frees them with everything else.
"""

from __future__ import annotations

from infinity.store._common import Tier
from infinity.store._copies import Copies
from infinity.store._entry import Copy, CopyState, Entry, Kept
from infinity.store._runner import MustWait
from infinity.store._tiers import Tiers


class KeptVersions:
    """keep, commit and rollback of entries' bytes; runs under the store's lock and never
    waits (see [Note: the store's lock] in `_runner`)."""

    def __init__(self, copies: Copies, tiers: Tiers) -> None:
        self._copies, self._tiers = copies, tiers

    def keep(self, entry: Entry) -> None:
        if entry.kept is not None:
            raise ValueError(f"{entry.key!r} is kept already: commit or roll it back first")
        tier = entry.home
        home = entry.copies[tier]
        if home.state is CopyState.FILLING:
            self._copies.need_idle(home)  # a write-back landing: keep what it writes
        if not home.current:  # a write-back failed: the current value is in a faster copy
            self._copies.write_down(entry)
            if home.busy:
                raise MustWait(home.move)
            if not home.current:
                raise RuntimeError(f"store: {entry.key!r} has no current copy to keep")
        if tier == Tier.NVME:
            entry.kept = Kept(tier, extent=home.extent, crc=home.crc,
                              shadow=self._tiers.shadow_extent(entry))
            return
        home.pins += 1  # making room for the kept block must not evict the bytes it copies
        try:
            block = self._tiers.kept_block(entry, tier, self._copies)
        finally:
            home.pins -= 1
            self._copies.refresh(entry)
        block.tensor.copy_(home.block.tensor)
        entry.kept = Kept(tier, block=block)

    def commit(self, entry: Entry) -> None:
        """Let the kept bytes go (no I/O, no wait)."""
        self._tiers.free_kept(self._kept(entry, "commit"))
        entry.kept = None

    def rollback(self, entry: Entry) -> None:
        """Make the kept bytes the entry's value again: every copy changed since goes (a move
        still running into one is waited for, its failure only logged)."""
        kept = self._kept(entry, "roll back")
        held = [t.label for t, c in entry.copies.items() if c.uses or c.pins]
        if held:
            raise ValueError(f"cannot roll back {entry.key!r}: it is in use or pinned on "
                             f"{', '.join(held)}")
        for copy in list(entry.copies.values()):
            self._copies.need_idle(copy, quiet=True)  # its bytes are discarded
        for tier in [t for t in entry.copies if kept.shadow is None or t != kept.tier]:
            self._tiers.free(entry, tier)
        if kept.shadow is not None:  # never written since keep: its extent is the kept one
            entry.copies[kept.tier].restore(kept.crc)
            self._tiers.swap.free(kept.shadow)
        else:
            copy = Copy(kept.tier, block=kept.block, extent=kept.extent)
            copy.restore(kept.crc)
            self._tiers.adopt(entry, copy)
        entry.kept = None
        self._copies.refresh(entry)
        self._tiers.room.changed()

    @staticmethod
    def _kept(entry: Entry, verb: str) -> Kept:
        if entry.kept is None:
            raise ValueError(f"cannot {verb} {entry.key!r}: nothing is kept (keep() it first; "
                             f"a kept version is committed or rolled back once)")
        return entry.kept
