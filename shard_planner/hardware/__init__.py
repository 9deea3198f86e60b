"""What the cost model knows of the device: its profile, allocator mode, measured module timings."""
