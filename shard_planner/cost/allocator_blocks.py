"""Blocks and free-block pools of the caching-allocator simulation (cost/allocator.py).

A block is a piece of a segment: allocated, free (cached) or, in an expandable segment, unmapped. The
blocks of one segment form a doubly linked list in address order (``prev`` / ``next``), as
``struct Block`` does in c10/cuda/CUDACachingAllocator.cpp. :class:`BlockPools` holds the free blocks
(``BlockPool::blocks``) and the unmapped ones (``BlockPool::unmapped``) of both pools, each keyed by
(pool, stream), and implements the three operations the rules need: best fit, split and merge.

[Note: Best fit per stream]
  ``get_free_block`` looks up ``pool.blocks``, a ``std::set`` ordered by ``BlockComparatorSize``:
  (stream, size, address). ``lower_bound`` with the key (stream, rounded size, address 0) finds the
  smallest free block of at least the requested size on the requesting stream (equal sizes: the lowest
  address), and gives up when the block found belongs to another stream. So a block freed on one stream
  is reused by that stream only; FSDP2's copy-in and reduce-scatter streams keep their own caches.
  Here each (pool, stream) has its own list of (size, address, block) sorted the same way: a lookup is one
  ``bisect``. The two ``max_split_size`` checks after the lookup (an oversize block is not returned for a
  smaller request, nor for a request more than ``max_non_split_rounding_size`` below it) never fire at
  the default ``max_split_size`` (unlimited) and are not modelled.

[Note: Splitting a block]
  ``alloc_found_block``: when ``should_split`` (cost/allocator.py [Note: When a block is split]) says
  so, the front of the block (its address) becomes the allocation and the rest stays a free block of
  the same segment, linked after it, back in the pool.

[Note: Merging free neighbours]
  ``free_block`` calls ``try_merge_blocks`` with the block's ``prev`` and then its ``next``: a neighbour
  that is free (not allocated, no pending stream events) and in the same mapped state is absorbed into
  the freed block, which takes the lower address. Neighbours exist only inside one segment, so free
  blocks of two ``cudaMalloc`` segments never merge, however close their sizes or addresses; blocks of an
  expandable segment all share one virtual range and merge whenever they touch. ``map_block`` and
  ``unmap_block`` (cost/allocator_expandable.py) merge the same way.
"""

from __future__ import annotations

from bisect import bisect_left, insort

# The allocator's constants (c10/cuda/CUDACachingAllocator.cpp; torch 2.13: c10/core/AllocatorConfig.h).
MiB = 1024 * 1024
K_MIN_BLOCK_SIZE = 512  # kMinBlockSize: every size is rounded up to a multiple of 512 B
K_SMALL_SIZE = 1 * MiB  # kSmallSize: the largest request served by the small pool
K_SMALL_BUFFER = 2 * MiB  # kSmallBuffer: the small pool's segments (and expandable segments' pages)
K_MIN_LARGE_ALLOC = 10 * MiB  # kMinLargeAlloc: below this a large request gets a kLargeBuffer segment
K_LARGE_BUFFER = 20 * MiB  # kLargeBuffer (torch 2.13: large_segment_size, default): large segments and pages
K_ROUND_LARGE = 2 * MiB  # kRoundLarge: larger requests get their own segment, rounded to 2 MiB


class Block:
    """A block: ``addr`` and ``size`` in bytes, the allocation ``stream``, the pool (``small``), the
    expandable segment it lies in (``segment``; None for a ``cudaMalloc`` segment), and its state."""

    __slots__ = ("addr", "size", "stream", "small", "segment", "allocated", "mapped", "prev", "next",
                 "requested")

    def __init__(self, addr: int, size: int, stream: int, small: bool, segment=None, mapped: bool = True):
        self.addr = addr
        self.size = size
        self.stream = stream
        self.small = small
        self.segment = segment
        self.allocated = False
        self.mapped = mapped
        self.prev: Block | None = None
        self.next: Block | None = None
        self.requested = 0  # the bytes asked for (before rounding) while allocated

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def __repr__(self) -> str:
        state = "allocated" if self.allocated else ("free" if self.mapped else "unmapped")
        return f"Block(addr={self.addr:#x}, size={self.size}, stream={self.stream}, {state})"


def expandable_size(block: Block) -> int:
    """The size a free block of an expandable segment can grow to: its own plus the unmapped block after
    it (``expandable_size`` in ``get_free_block``; cost/allocator_expandable.py [Note: Best fit in an
    expandable segment])."""
    nxt = block.next
    return block.size + (nxt.size if nxt is not None and not nxt.mapped else 0)


class BlockPools:
    """The free (mapped) blocks per (pool, stream), each list sorted by (size, address), and the unmapped
    blocks of expandable segments per (pool, stream), sorted by address. ``small``: the small pool."""

    __slots__ = ("free", "unmapped")

    def __init__(self):
        self.free: dict[tuple[bool, int], list[tuple[int, int, Block]]] = {}
        self.unmapped: dict[tuple[bool, int], list[tuple[int, Block]]] = {}

    # -- free blocks ---------------------------------------------------------------------------------------

    def insert(self, block: Block) -> None:
        """Caches a free block (``BlockPool::insert_into_blocks``)."""
        key = (block.small, block.stream)
        lst = self.free.get(key)
        if lst is None:
            lst = self.free[key] = []
        insort(lst, (block.size, block.addr, block))

    def remove(self, block: Block) -> None:
        lst = self.free[block.small, block.stream]
        i = bisect_left(lst, (block.size, block.addr))
        assert lst[i][2] is block, block
        del lst[i]

    def take_best_fit(self, small: bool, stream: int, size: int, expandable: bool) -> Block | None:
        """Removes and returns the free block ``get_free_block`` picks for ``size`` bytes on ``stream``, or
        None. See [Note: Best fit per stream]; with expandable segments the choice then moves past blocks
        at the end of a segment's mapped range (cost/allocator_expandable.py [Note: Best fit in an
        expandable segment])."""
        lst = self.free.get((small, stream))
        if not lst:
            return None
        i = bisect_left(lst, (size,))
        if i == len(lst):
            return None
        if expandable:
            block = lst[i][2]
            while i + 1 < len(lst) and expandable_size(lst[i + 1][2]) < expandable_size(block):
                i += 1
                block = lst[i][2]
        return lst.pop(i)[2]

    def free_blocks(self, small: bool) -> list[Block]:
        """Every free block of one pool, all streams, in the pool's order (stream, size, address)."""
        return [entry[2] for key in sorted(k for k in self.free if k[0] == small) for entry in self.free[key]]

    # -- unmapped blocks (expandable segments) -------------------------------------------------------------

    def insert_unmapped(self, block: Block) -> None:
        key = (block.small, block.stream)
        lst = self.unmapped.get(key)
        if lst is None:
            lst = self.unmapped[key] = []
        insort(lst, (block.addr, block))

    def remove_unmapped(self, block: Block) -> None:
        lst = self.unmapped[block.small, block.stream]
        i = bisect_left(lst, (block.addr,))
        assert lst[i][1] is block, block
        del lst[i]

    def unmapped_blocks(self, small: bool, stream: int) -> list[Block]:
        """The unmapped blocks of one (pool, stream), lowest address first (a copy)."""
        return [entry[1] for entry in self.unmapped.get((small, stream), ())]

    # -- split and merge -----------------------------------------------------------------------------------

    def split(self, block: Block, size: int) -> Block:
        """The front ``size`` bytes of the (taken) free ``block`` as a new block; the rest stays ``block``,
        moved up by ``size`` and cached again. See [Note: Splitting a block]."""
        front = Block(block.addr, size, block.stream, block.small, block.segment)
        front.prev = block.prev
        if front.prev is not None:
            front.prev.next = front
        front.next = block
        block.prev = front
        block.addr += size
        block.size -= size
        self.insert(block)
        return front

    def try_merge(self, dst: Block, src: Block | None) -> int:
        """Absorbs the neighbour ``src`` into ``dst`` (not in any list) when ``src`` is free and in the same
        mapped state; returns the bytes absorbed (``try_merge_blocks``). See [Note: Merging free
        neighbours]."""
        if src is None or src.allocated or src.mapped != dst.mapped:
            return 0
        if dst.prev is src:  # [src dst]
            dst.addr = src.addr
            dst.prev = src.prev
            if dst.prev is not None:
                dst.prev.next = dst
        else:  # [dst src]
            dst.next = src.next
            if dst.next is not None:
                dst.next.prev = dst
        if src.mapped:
            self.remove(src)
        else:
            self.remove_unmapped(src)
        dst.size += src.size
        return src.size

    def merge_neighbours(self, block: Block) -> None:
        """``try_merge_blocks`` with ``prev``, then with ``next``."""
        self.try_merge(block, block.prev)
        self.try_merge(block, block.next)
