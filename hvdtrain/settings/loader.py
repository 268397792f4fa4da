"""The ShmLoader's sizes that the launcher needs too: `hvdtrain render k8s` sizes a worker pod's /dev/shm from them
(hvdtrain/render/shmsize.py); hvdtrain/data/loader.py uses them as its defaults."""

PREFETCH = 2
"""ShmLoader's default `prefetch`: batches each producer builds ahead, in prefetch + 1 slots."""

SLOT_BYTES = 1 << 20
"""Each slot's first segment, made before the workers start, so that a batch that fits never waits for a GrowSlot
round trip (one for every worker's every slot, all paid in the first steps, while the trainer is busy elsewhere;
their cost: docs/performance.md). A segment is a sparse /dev/shm file: only the pages a batch writes take memory."""
