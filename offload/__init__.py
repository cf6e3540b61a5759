"""Where a model's parts live and how fast they move: the hardware probe, the placement plan (GPU / RAM / SSD),
SSD streaming, and tree-budget tuning from measured pass times. `offload.libc` holds the memory calls (mmap,
madvise, mincore) the streaming and the probe make through ctypes."""
