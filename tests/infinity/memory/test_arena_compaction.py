"""Compaction: adversarial alloc/free sequences, contents that survive moves, params that train."""

import itertools
import random

import pytest
import torch

from infinity.errors import BudgetError
from infinity.memory import Arena, Block

_DTYPES = (torch.uint8, torch.float16, torch.bfloat16, torch.float32, torch.int64, torch.float64)


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """These tests make many tiny copies and compares; on 2 shared cores the barriers of
    intra-op threads cost more than the work (the suite ran 1-10x slower with 2 threads)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _round_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def _as_bytes(block: Block) -> torch.Tensor:
    return block.tensor.reshape(-1).view(torch.uint8)


def _check_all(live: list[tuple[Block, torch.Tensor]]) -> None:
    for block, pattern in live:
        assert torch.equal(_as_bytes(block), pattern), block


def _adversarial(seed: int, ops: int, capacity: int, alignment: int) -> tuple[int, int]:
    """Random sizes and lifetimes in a small arena kept near full; returns (compactions, fails).

    Every allocation whose aligned size fits in the total free space must succeed, every other
    must raise BudgetError, and every block must read back the unique bytes written into it.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    arena = Arena(capacity, pinned=False, alignment=alignment)
    live: list[tuple[Block, torch.Tensor]] = []
    free = arena.capacity_nbytes
    compactions = fails = 0
    for _ in range(ops):
        occupancy = 1 - free / arena.capacity_nbytes
        if live and rng.random() < occupancy**4:  # hovers around 85% full
            i = rng.randrange(len(live))
            live[i], live[-1] = live[-1], live[i]
            block, pattern = live.pop()
            assert torch.equal(_as_bytes(block), pattern), block
            arena.free(block)
            free += _round_up(block.nbytes, alignment)
        else:
            dtype = rng.choice(_DTYPES)
            big = rng.random() < 0.1
            numel = rng.randint(0, capacity // (6 if big else 200)) // dtype.itemsize
            shape = (numel,) if numel % 4 or rng.random() < 0.5 else (numel // 4, 4)
            span = _round_up(numel * dtype.itemsize, alignment)
            if span > free:
                with pytest.raises(BudgetError):
                    arena.alloc(shape, dtype)
                fails += 1
                continue
            block = arena.alloc(shape, dtype)
            free -= span
            pattern = torch.randint(0, 256, (block.nbytes,), dtype=torch.uint8, generator=gen)
            _as_bytes(block).copy_(pattern)
            live.append((block, pattern))
            done = arena.stats().compactions
            if done != compactions:
                compactions = done
                _check_all(live)
        assert arena.stats().free_nbytes == free
    _check_all(live)
    stats = arena.stats()
    assert stats.live_blocks == len(live)
    assert stats.live_nbytes == sum(_round_up(b.nbytes, alignment) for b, _ in live)
    return compactions, fails


@pytest.mark.parametrize(
    ("seed", "capacity", "alignment"),
    [(0, 1 << 18, 256), (1, 1 << 18, 16), (2, 1 << 20, 4096), (3, 3 << 16, 512)],
)
def test_adversarial_sequences_fit_whenever_free_space_allows(seed, capacity, alignment):
    compactions, fails = _adversarial(seed, ops=25_000, capacity=capacity, alignment=alignment)
    assert compactions > 50  # the sequences really do fragment the arena
    assert fails > 0  # and really do run it out of space


def test_compaction_moves_blocks_down_and_their_views_follow():
    arena = Arena(64 * 1024, pinned=False, alignment=1024)
    blocks = [arena.alloc(1000, torch.uint8) for _ in range(64)]
    for i, block in enumerate(blocks):
        block.tensor.fill_(i)
    for block in blocks[::2]:
        arena.free(block)  # 32 holes of 1024 bytes, none larger
    old_views = {id(b): b.tensor for b in blocks[1::2]}
    big = arena.alloc(4 * 1024, torch.uint8)
    stats = arena.stats()
    assert stats.compactions == 1
    assert stats.moved_nbytes == 32 * 1000  # every odd block moved, its used bytes only
    assert stats.largest_hole_nbytes == stats.free_nbytes == 64 * 1024 - 33 * 1024 - 3 * 1024
    assert big.offset == 32 * 1024
    for rank, (i, block) in enumerate(zip(range(1, 64, 2), blocks[1::2], strict=True)):
        assert block.offset == rank * 1024
        assert block.tensor.data_ptr() != old_views[id(block)].data_ptr()
        assert bool((block.tensor == i).all())


def test_explicit_compact_returns_bytes_moved_and_is_idempotent():
    arena = Arena(16 * 1024, pinned=False)
    a, b = arena.alloc(4096, torch.uint8), arena.alloc(4096, torch.uint8)
    b.tensor.fill_(7)
    arena.free(a)
    assert arena.compact() == 4096
    assert arena.compact() == 0
    assert b.offset == 0
    assert bool((b.tensor == 7).all())
    assert arena.stats().compactions == 2


@pytest.mark.parametrize("gap", [256, 4096, (1 << 20) + 256, 3 << 20])
def test_large_overlapping_moves_keep_contents(gap):
    """Blocks larger than the gap they slide over, from a gap of a few bytes to several MiB."""
    block_nbytes, tail = 5 << 20, 4096
    arena = Arena(gap + block_nbytes + tail, pinned=False)
    hole = arena.alloc(gap, torch.uint8)
    moving = arena.alloc(block_nbytes // 4, torch.int32)
    pattern = torch.randint(-(2**31), 2**31 - 1, (block_nbytes // 4,), dtype=torch.int32)
    moving.tensor.copy_(pattern)
    arena.free(hole)
    arena.alloc(gap + tail, torch.uint8)  # fits only once the gap is closed
    assert arena.stats().compactions == 1
    assert moving.offset == 0
    assert torch.equal(moving.tensor, pattern)


def test_compaction_around_kept_blocks_leaves_them_and_their_views_in_place():
    """Kept blocks (a view handed out, I/O targeting them) stay put; the others slide down past
    them, each to the lowest place that overlaps no kept block, and read back their bytes."""
    arena = Arena(16 * 1024, pinned=False, alignment=1024)
    blocks = [arena.alloc(1000, torch.uint8) for _ in range(16)]
    for i, block in enumerate(blocks):
        block.tensor.fill_(i)
    kept = [blocks[5], blocks[9]]
    views = {id(b): b.tensor for b in kept}
    for i in (0, 1, 3, 6, 7, 11, 12, 14):
        arena.free(blocks[i])
    # live: 2 4 [5] 8 [9] 10 13 15; holes of 1-2 KiB between them
    moved = arena.compact(keep=kept)
    places = {i: blocks[i].offset // 1024 for i in (2, 4, 5, 8, 9, 10, 13, 15)}
    assert places == {2: 0, 4: 1, 5: 5, 8: 2, 9: 9, 10: 3, 13: 4, 15: 6}
    assert moved == 6 * 1000  # 15 jumped from 15 to 6 (past kept 5); 2, 4, 8, 10, 13 slid down
    for i in (2, 4, 5, 8, 9, 10, 13, 15):
        assert bool((blocks[i].tensor == i).all()), i
    for block in kept:
        assert block.tensor.data_ptr() == views[id(block)].data_ptr()
    holes = arena._free.holes()
    assert holes == [(7 * 1024, 2 * 1024), (10 * 1024, 6 * 1024)]
    stats = arena.stats()
    assert stats.largest_hole_nbytes == 6 * 1024 and stats.free_nbytes == 8 * 1024
    assert arena.compact(keep=kept) == 0  # nothing left to move


def test_compaction_keeping_every_block_moves_nothing():
    arena = Arena(8 * 1024, pinned=False, alignment=1024)
    blocks = [arena.alloc(1024, torch.uint8) for _ in range(8)]
    for block in blocks[::2]:
        arena.free(block)
    assert arena.compact(keep=blocks[1::2]) == 0
    assert [b.offset for b in blocks[1::2]] == [1024, 3072, 5120, 7168]
    assert arena.stats().largest_hole_nbytes == 1024


def test_compaction_keep_rejects_a_block_of_another_arena():
    arena, other = Arena(4096, pinned=False), Arena(4096, pinned=False)
    with pytest.raises(ValueError, match="belongs to"):
        arena.compact(keep=[other.alloc(16, torch.uint8)])


def _random_compactions(seed: int, ops: int, kept_share: int, compact) -> Arena:
    """Random allocs and frees in a 64 KiB arena; where a request fits in no hole, a random
    `1 / kept_share` of the blocks is kept and `compact(arena, live, kept, need)` runs. Checked
    after each: contents survive, kept blocks stay, the holes are exactly the gaps between
    blocks and no block overlaps another."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    arena = Arena(1 << 16, pinned=False, alignment=256)
    live: list[tuple[Block, torch.Tensor]] = []
    for _ in range(ops):
        stats = arena.stats()
        if live and rng.random() < (stats.live_nbytes / stats.capacity_nbytes) ** 2:
            block, _ = live.pop(rng.randrange(len(live)))
            arena.free(block)
            continue
        nbytes = rng.randint(1, 6000)
        need = _round_up(nbytes, 256)
        if need > arena.stats().largest_hole_nbytes:
            kept = [b for b, _ in rng.sample(live, k=len(live) // kept_share)]
            where = {id(b): b.offset for b in kept}
            compact(arena, live, kept, need)
            assert all(b.offset == where[id(b)] for b in kept)
            _check_all(live)
            spans = sorted((b.offset, b.offset + _round_up(b.nbytes, 256)) for b, _ in live)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
            assert sum(n for _, n in arena._free.holes()) == arena.stats().free_nbytes
            if need > arena.stats().largest_hole_nbytes:
                continue
        block = arena.alloc(nbytes, torch.uint8)
        pattern = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=gen)
        block.tensor.copy_(pattern)
        live.append((block, pattern))
    _check_all(live)
    return arena


def _holey_arena() -> tuple[Arena, list[Block], list[int]]:
    """16 blocks of 1 KiB, block i filled with i, with holes at 1, 3, 10, 12 and 13: the arena,
    the blocks and the indices still live."""
    arena = Arena(16 * 1024, pinned=False, alignment=1024)
    blocks = [arena.alloc(1024, torch.uint8) for _ in range(16)]
    for i, block in enumerate(blocks):
        block.tensor.fill_(i)
    holes = (1, 3, 10, 12, 13)
    for i in holes:
        arena.free(blocks[i])
    return arena, blocks, [i for i in range(16) if i not in holes]


def _assert_filled(blocks: list[Block], live: list[int]) -> None:
    for i in live:
        assert bool((blocks[i].tensor == i).all()), i


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_compactions_around_kept_blocks_keep_every_byte(seed):
    """Random layouts, random kept sets (see _random_compactions)."""
    arena = _random_compactions(seed, 2000, 4,
                                lambda arena, live, kept, need: arena.compact(keep=kept))
    assert arena.stats().compactions > 10  # the layouts really were fragmented


def test_compacting_for_a_need_moves_only_the_cheapest_stretch():
    """Holes of 1 KiB at 1, 3 and 10 and of 2 KiB at 12-13: 3 KiB is gathered by sliding block
    11 alone down to 10, not by moving everything above the first hole."""
    arena, blocks, live = _holey_arena()
    before = {i: blocks[i].offset for i in live}
    assert arena.compact(need=3 * 1024) == 1024
    assert {i: blocks[i].offset for i in live} == {**before, 11: 10 * 1024}
    assert (11 * 1024, 3 * 1024) in arena._free.holes()
    assert arena.stats().largest_hole_nbytes == 3 * 1024
    _assert_filled(blocks, live)
    # all 5 KiB free: the stretch from the hole at 1 to the hole at 11-13; 14 and 15 stay,
    # where a full compaction would slide them too
    assert arena.compact(need=5 * 1024) == 8 * 1024
    assert (blocks[14].offset, blocks[15].offset) == (14 * 1024, 15 * 1024)
    assert arena._free.holes() == [(9 * 1024, 5 * 1024)]
    _assert_filled(blocks, live)


def test_compacting_for_a_need_leaves_kept_blocks_and_moves_nothing_without_a_stretch():
    """A kept block splits the stretches: the cheapest one that does not cross it moves; when
    no stretch holds `need` free bytes nothing moves (the caller evicts, or compacts everything,
    which slides blocks past the kept one)."""
    arena, blocks, live = _holey_arena()
    # 4 KiB: 3 free below kept block 11, 2 above it: no stretch, nothing moves
    before = {i: blocks[i].offset for i in live}
    assert arena.compact(keep=[blocks[11]], need=4 * 1024) == 0
    assert {i: blocks[i].offset for i in live} == before and arena.stats().compactions == 0
    # 3 KiB: the stretch below block 11 that gathers the holes at 1, 3 and 10
    assert arena.compact(keep=[blocks[11]], need=3 * 1024) == 7 * 1024  # 2, 4..9; 0 stays
    assert blocks[11].offset == 11 * 1024 and blocks[0].offset == 0
    assert (8 * 1024, 3 * 1024) in arena._free.holes()
    _assert_filled(blocks, live)
    # everything (no need): 14 and 15 slide below kept 11, gathering 4 KiB above it
    assert arena.compact(keep=[blocks[11]]) == 2 * 1024
    assert [blocks[i].offset // 1024 for i in (14, 15)] == [8, 9]
    assert arena.stats().largest_hole_nbytes == 4 * 1024


def _cheapest_by_brute_force(arena, keep, need):
    """The fewest bytes (aligned spans) a stretch of consecutive unkept blocks must move to open
    a hole of `need`; None when no stretch can."""
    live = sorted(arena._live, key=lambda b: b.offset)
    best = None
    for i in range(len(live)):
        for j in range(i + 1, len(live) + 1):
            if any(b in keep for b in live[i:j]):
                break
            lo = live[i - 1].offset + _round_up(live[i - 1].nbytes, 256) if i else 0
            hi = live[j].offset if j < len(live) else arena.capacity_nbytes
            spans = sum(_round_up(b.nbytes, 256) for b in live[i:j])
            if hi - lo - spans >= need:
                best = spans if best is None else min(best, spans)
                break
    return best


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_compactions_for_a_need_move_the_fewest_bytes_and_keep_every_byte(seed):
    """Random layouts, kept sets and needs: the hole opens and no other stretch would have
    moved fewer bytes (brute force over every stretch); nothing moves where none can; and what
    _random_compactions checks."""
    opened = []

    def compact(arena, live, kept, need):
        offsets = {id(b): b.offset for b, _ in live}
        cheapest = _cheapest_by_brute_force(arena, set(kept), need)
        arena.compact(keep=kept, need=need)
        moved = sum(_round_up(b.nbytes, 256) for b, _ in live if b.offset != offsets[id(b)])
        if cheapest is None:  # no stretch: nothing moved
            assert moved == 0
        else:  # the blocks that moved are the cheapest stretch, and the hole is there
            assert moved == cheapest and arena.stats().largest_hole_nbytes >= need
            opened.append(need)
    _random_compactions(seed, 1500, 5, compact)
    assert len(opened) > 10  # many layouts had a stretch to open
