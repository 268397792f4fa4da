"""How many shard files or arrays a process keeps mapped (each mapping holds a file descriptor).

A uniform shuffle touches up to a batch's worth of shards per batch: with too few maps every batch re-opens most of
them, so take as many as a quarter of the descriptor limit allows (at least 16, at most 512).
"""

from __future__ import annotations

import resource

_NOFILE = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
MAX_OPEN = 512 if _NOFILE == resource.RLIM_INFINITY else max(16, min(512, _NOFILE // 4))
