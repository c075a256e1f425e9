"""Storage tiers of one node: GPU memory, the DRAM arena, the SSD directory."""
