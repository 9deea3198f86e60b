"""Expandable segments in the caching-allocator simulation (``expandable_segments:True``).

c10/cuda/CUDACachingAllocator.cpp, Note [Expandable Segments], ``struct ExpandableSegment`` and the
``DeviceCachingAllocator`` methods named below. cost/allocator.py calls :class:`ExpandableSegments` in
place of ``cudaMalloc`` / ``cudaFree`` when the configuration enables them; the blocks and pools are
cost/allocator_blocks.py's.

[Note: Expandable segments grow page by page]
  An ``ExpandableSegment`` reserves a virtual range (``cuMemAddressReserve``) of 1 1/8 of the GPU's memory
  and maps physical pages into it on demand (``cuMemCreate`` + ``cuMemMap``): pages of ``kSmallBuffer``
  (2 MiB) in the small pool and ``kLargeBuffer`` (20 MiB) in the large pool, the ``segment_size`` that
  ``find_expandable_block`` passes. (torch 2.13's c10/core/AllocatorConfig.h makes the large size a setting,
  ``large_segment_size_mb``, default 20 MiB; this simulation keeps the default.) A new segment starts as one
  unmapped block covering the whole range, in the pool's ``unmapped`` set for its stream.
  ``try_allocate_expandable_block`` (from ``alloc_block``, when no cached block fits) takes the lowest
  address where free and unmapped blocks together give the request room (``find_expandable_block``: for
  each unmapped block of the (pool, stream) in address order, starting from the free block just before it
  when there is one). It maps the unmapped part, rounded up to whole pages (``ExpandableSegment::map``),
  and ``map_block`` merges the new pages with the free neighbours. So a segment is normally one growing
  block chain per (pool, stream): a second segment is made only when no unmapped range of the existing
  ones has room, which within 1 1/8 of the GPU's memory means after one was released whole. The block
  found is then split like any other (with expandable segments, whenever 512 B or more remain).

[Note: Best fit in an expandable segment]
  ``get_free_block`` with expandable segments: after the size lookup, while the block found is followed
  (same stream) by a free block whose "expandable size" is smaller, take that one instead; the expandable
  size of a free block is its size plus that of an unmapped block right after it (``expandable_size``).
  A free block at the end of the mapped range therefore counts as huge, and a request goes to an interior
  free block of at least its size when there is one, keeping the growing end free.

[Note: Releasing expandable segments]
  ``release_cached_blocks`` -> ``release_blocks``: every free block of an expandable segment is passed to
  ``unmap_block``, which unmaps the whole pages inside it (``ExpandableSegment::unmap``: from its start
  rounded up to its end rounded down to the page) and keeps the parts before and after as free blocks. The
  unmapped block merges with unmapped neighbours; when it is then the segment's only block, the segment
  is destroyed (``release_expandable_segment``). Unmapped holes in the middle are reused first, because
  ``find_expandable_block`` takes the lowest address.

[Note: Mapping under a memory limit]
  ``ExpandableSegment::map`` creates the pages one by one and, when ``cuMemCreate`` runs out of memory,
  releases the pages it created in that call and fails: all or nothing per call. But
  ``try_allocate_expandable_block`` may call ``map_block`` twice (a hole or free block, then the range after
  it); when the second fails, the first stays mapped (merged into the free blocks) and the allocation
  fails. ``headroom_bytes`` is the physical memory left; the cap of ``set_per_process_memory_fraction`` is
  checked before, in ``alloc_block`` (cost/allocator.py [Note: The cap and the device's memory]).

[Note: One driver call per page]
  ``ExpandableSegment::map`` creates each page of the range on its own (``cuMemCreate`` of one
  ``segment_size``, a handle per page) and maps them (``cuMemMap`` per handle, then ``cuMemSetAccess``);
  ``ExpandableSegment::unmap`` unmaps and releases each page's handle (``cuMemUnmap``, ``cuMemRelease``). So
  the driver work of a map or unmap grows with its pages, not its ranges: ``pages_mapped`` /
  ``pages_unmapped`` count them, for the price of a retry (cost/retries.py).

[Note: Simulated addresses]
  The simulation gives each expandable segment a virtual range of ``ADDRESS_SPACE_BYTES`` (16 TiB, more
  than 1 1/8 of any GPU), placed above the previous one; the real reservation is 1 1/8 of the GPU's memory
  at an address the driver picks. The difference shows only in a segment whose mapped extent nears that
  size (a new segment would be made earlier on the GPU), or in the order of two segments of one
  (pool, stream), which exist only after a release.
"""

from __future__ import annotations

from shard_planner.cost.allocator_blocks import K_LARGE_BUFFER, K_SMALL_BUFFER, Block, BlockPools

ADDRESS_SPACE_BYTES = 1 << 44  # the simulated virtual range of one segment ([Note: Simulated addresses])


class ExpandableSegment:
    """One reserved virtual range: ``base`` address, ``page_bytes``, and the (pool, stream) it serves."""

    __slots__ = ("base", "page_bytes", "small", "stream")

    def __init__(self, base: int, small: bool, stream: int):
        self.base = base
        self.page_bytes = K_SMALL_BUFFER if small else K_LARGE_BUFFER
        self.small = small
        self.stream = stream

    def map_bytes(self, nbytes: int) -> int:
        """The bytes ``ExpandableSegment::map`` maps for ``nbytes`` from a page-aligned start: whole pages."""
        page = self.page_bytes
        return -(-nbytes // page) * page

    def unmap_range(self, addr: int, size: int) -> tuple[int, int]:
        """(start address, bytes) of the whole pages inside [addr, addr + size) (``ExpandableSegment::unmap``);
        0 bytes when there is none."""
        page = self.page_bytes
        begin = -(-(addr - self.base) // page)
        end = (addr + size - self.base) // page
        if begin >= end:
            return addr, 0
        return self.base + begin * page, (end - begin) * page


class ExpandableSegments:
    """The expandable segments of one simulated allocator, over its :class:`BlockPools`. Counts
    ``num_maps`` / ``num_unmaps`` (the allocator's ``num_device_alloc`` / ``num_device_free``: one per mapped
    or unmapped range) and ``pages_mapped`` / ``pages_unmapped`` (the driver calls: [Note: One driver call per
    page])."""

    def __init__(self, pools: BlockPools):
        self.pools = pools
        self.segments: list[ExpandableSegment] = []
        self._next_base = ADDRESS_SPACE_BYTES
        self.num_maps = 0
        self.num_unmaps = 0
        self.pages_mapped = 0
        self.pages_unmapped = 0

    def try_allocate(self, small: bool, stream: int, size: int, headroom_bytes: int | None) -> tuple[Block | None, int]:
        """(a free block of at least ``size`` bytes, taken out of the pool, or None; the bytes mapped) —
        ``try_allocate_expandable_block``. ``headroom_bytes``: the physical memory left (None: unlimited).
        Bytes mapped before a failure stay mapped ([Note: Mapping under a memory limit])."""
        candidate = self._find_block(small, stream, size)
        mapped = 0
        if not candidate.mapped:
            got = self._map_block(candidate, min(candidate.size, size), headroom_bytes)
            if not got:
                return None, 0
            mapped += got
        while candidate.size < size:  # free -> unmapped -> ...: map the rest and merge
            nxt = candidate.next
            got = self._map_block(nxt, min(size - candidate.size, nxt.size),
                                  None if headroom_bytes is None else headroom_bytes - mapped)
            if not got:
                return None, mapped
            mapped += got
            candidate = nxt
        self.pools.remove(candidate)
        return candidate, mapped

    def release(self, small: bool) -> int:
        """Unmaps the free pages of every expandable segment of one pool and destroys the segments left
        without a mapped page; returns the bytes unmapped. See [Note: Releasing expandable segments]."""
        unmapped = 0
        for block in self.pools.free_blocks(small):
            if block.segment is None:
                continue
            unmapped += self._unmap_block(block)
            if not block.mapped and not block.is_split():
                self.pools.remove_unmapped(block)
                self.segments.remove(block.segment)
        return unmapped

    def _find_block(self, small: bool, stream: int, size: int) -> Block:
        """The lowest-address free-or-unmapped block with room for ``size`` bytes from it on, or the single
        unmapped block of a new segment (``find_expandable_block``)."""
        for block in self.pools.unmapped_blocks(small, stream):
            prev = block.prev
            start = prev if prev is not None and not prev.allocated else block
            room, b = 0, start
            while room < size and b is not None and not b.allocated:
                room += b.size
                b = b.next
            if room >= size:
                return start
        segment = ExpandableSegment(self._next_base, small, stream)
        self._next_base += ADDRESS_SPACE_BYTES
        self.segments.append(segment)
        block = Block(segment.base, ADDRESS_SPACE_BYTES, stream, small, segment, mapped=False)
        self.pools.insert_unmapped(block)
        return block

    def _map_block(self, block: Block, nbytes: int, headroom_bytes: int | None) -> int:
        """Maps the first ``nbytes`` (rounded up to pages) of the unmapped ``block``, merges it with its free
        neighbours and caches it; returns the bytes mapped, 0 when the memory is not there (``map_block``)."""
        mapped = block.segment.map_bytes(nbytes)
        if headroom_bytes is not None and mapped > headroom_bytes:
            return 0
        pools = self.pools
        pools.remove_unmapped(block)
        block.mapped = True
        if mapped < block.size:  # block -> rest (unmapped) -> block.next
            rest = Block(block.addr + mapped, block.size - mapped, block.stream, block.small, block.segment,
                         mapped=False)
            rest.prev, rest.next = block, block.next
            if block.next is not None:
                block.next.prev = rest
            block.next = rest
            pools.insert_unmapped(rest)
            block.size = mapped
        pools.merge_neighbours(block)
        pools.insert(block)
        self.num_maps += 1
        self.pages_mapped += mapped // block.segment.page_bytes
        return mapped

    def _unmap_block(self, block: Block) -> int:
        """Unmaps the whole pages inside the free ``block`` (``unmap_block``): the parts before and after stay
        free blocks, the unmapped part merges with unmapped neighbours. Returns the bytes unmapped."""
        start, nbytes = block.segment.unmap_range(block.addr, block.size)
        if nbytes == 0:
            return 0
        pools = self.pools
        pools.remove(block)
        before, after = start - block.addr, block.addr + block.size - (start + nbytes)
        if before > 0:  # prev -> head -> block
            head = Block(block.addr, before, block.stream, block.small, block.segment)
            head.prev, head.next = block.prev, block
            if block.prev is not None:
                block.prev.next = head
            block.prev = head
            pools.insert(head)
        if after > 0:  # block -> tail -> next
            tail = Block(start + nbytes, after, block.stream, block.small, block.segment)
            tail.prev, tail.next = block, block.next
            if block.next is not None:
                block.next.prev = tail
            block.next = tail
            pools.insert(tail)
        block.addr, block.size, block.mapped = start, nbytes, False
        pools.merge_neighbours(block)
        pools.insert_unmapped(block)
        self.num_unmaps += 1
        self.pages_unmapped += nbytes // block.segment.page_bytes
        return nbytes
