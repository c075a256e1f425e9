"""What the embedded pool and a storage node share: the extent allocator, the
shared-memory DRAM arena, the memory tier (DRAM or GPU) and the SSD tier."""
