"""The one error type of hvdtrain.stream: a dataset, shard, URL or cache that cannot be used (the message names
the file or URL, what is wrong and how to fix it)."""

from __future__ import annotations


class StreamError(ValueError):
    """A dataset, shard, URL or cache that cannot be used; the message names it and says why."""
