"""The error type of hvdtrain.stream: a dataset, shard, URL or cache that cannot be used (the message names the file or
URL, what is wrong and how to fix it). It is a `DataError` (hvdtrain.data.errors), which is what callers catch."""

from __future__ import annotations

from hvdtrain.data.errors import DataError


class StreamError(DataError):
    """A dataset, shard, URL or cache that cannot be used; the message names it and says why."""
