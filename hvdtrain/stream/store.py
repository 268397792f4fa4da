"""Where a dataset's files come from: a directory (local disk or a shared filesystem) or an object store URL.

`open_store(source)` -> a `Store` whose `get(name)` returns the bytes of one file of the dataset (its index.json,
a shard). URLs (`s3://bucket/prefix`, `gs://bucket/prefix`, `http(s)://host/prefix`) are read with obstore (Rust's
object_store: chosen over fsspec/s3fs on measured throughput and CPU per GiB, and because it brings no botocore pin;
bench/transport_choice.py). S3 takes the usual AWS environment variables (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_SESSION_TOKEN, AWS_REGION / AWS_DEFAULT_REGION, AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 for S3-compatible servers
such as MinIO or moto; an `http://` endpoint is allowed), GCS its own (GOOGLE_APPLICATION_CREDENTIALS, ...).

Errors: a missing object (404) or refused access (401/403) is permanent and raised at once, naming the URL; anything
else (connection refused, reset, timeout, 5xx) is retried with exponential backoff until `retry_s` seconds
(`$HVDTRAIN_STREAM_RETRY_S`, default 120) have passed since the first failure, then raised naming the URL, the
last error and how long it was retried. Every error is a StreamError.
"""

from __future__ import annotations

import math
import os
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

from hvdtrain.stream.errors import StreamError

REMOTE_SCHEMES = ("s3", "gs", "http", "https")
ENV_RETRY = "HVDTRAIN_STREAM_RETRY_S"
DEFAULT_RETRY_S = 120.0
COALESCE = 16 << 10  # get_ranges: ranges closer than this are one request (adjacent rows of a shard)
RANGES_TIMEOUT_S = 150.0  # get_ranges waits this long for its threads (obstore's own request timeout is 120 s)
T = TypeVar("T")


def is_url(source: str | os.PathLike[str]) -> bool:
    """True for `scheme://...` with a scheme hvdtrain reads (StreamError for another scheme)."""
    text = os.fspath(source)
    if "://" not in text:
        return False
    scheme = text.split("://", 1)[0].lower()
    if scheme == "file":
        return False
    if scheme not in REMOTE_SCHEMES:
        raise StreamError(f"{text}: the URL scheme {scheme!r} is not supported; use a directory, file://, "
                          f"{', '.join(s + '://' for s in REMOTE_SCHEMES)}")
    return True


def normalise(source: str | os.PathLike[str]) -> str:
    """A URL without its trailing slash, or an absolute path (file:// URLs become paths)."""
    text = os.fspath(source)
    if text.startswith("file://"):
        text = text[len("file://"):]
    if is_url(text):
        return text.rstrip("/")
    return os.path.abspath(text)


def join(source: str, name: str) -> str:
    """`source`/`name` for a URL or a path (a split of a dataset root, a file of a split)."""
    return f"{source.rstrip('/')}/{name}" if is_url(source) else os.path.join(source, name)


def env_number(name: str, default: float, low: float, high: float, what: str) -> float:
    """The number in environment variable `name` (`default` when unset); StreamError naming it, its value and
    `what` it means when it is not a number from `low` to `high`."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not low <= value <= high:
        raise StreamError(f"{name}={text!r} is not allowed: give {what}")
    return value


def retry_seconds() -> float:
    return env_number(ENV_RETRY, DEFAULT_RETRY_S, 0.0, math.inf, "the seconds to keep retrying a store that does "
                      f"not answer, a number >= 0 (default {DEFAULT_RETRY_S:.0f})")


class Store:
    """The files of one dataset directory (`source`): `get(name) -> bytes`."""

    def __init__(self, source: str) -> None:
        self.source = source

    def url(self, name: str) -> str:
        return join(self.source, name)

    def get(self, name: str) -> bytes | memoryview:
        raise NotImplementedError

    @property
    def local_dir(self) -> Path | None:
        """The directory when the files are on a filesystem (read in place), else None."""
        return None


class LocalStore(Store):
    @property
    def local_dir(self) -> Path:
        return Path(self.source)

    def get(self, name: str) -> bytes:
        path = Path(self.source) / name
        try:
            return path.read_bytes()
        except FileNotFoundError:
            raise StreamError(f"{path} does not exist") from None
        except OSError as e:
            raise StreamError(f"{path}: cannot read ({e.strerror or e})") from None


class RemoteStore(Store):
    """An object store prefix read with obstore; the client is made in each process that reads (not pickled)."""

    def __init__(self, source: str, retry_s: float | None = None) -> None:
        super().__init__(source)
        self.retry_s = retry_seconds() if retry_s is None else retry_s
        self._client: Any = None

    def _store(self) -> Any:
        if self._client is None:
            from obstore.store import from_url

            options: dict[str, Any] = {"connect_timeout": "5s", "timeout": "120s"}
            if _http_allowed(self.source):  # passing client_options makes obstore ignore AWS_ALLOW_HTTP
                options["allow_http"] = True
            # Few retries inside obstore: the deadline and the error message are ours (get()).
            retry = {"max_retries": 1, "retry_timeout": _timedelta(5.0)}
            try:
                self._client = from_url(self.source, client_options=options, retry_config=retry)
            except Exception as e:  # obstore's configuration errors are its own types
                raise StreamError(f"{self.source}: cannot open this store: {_first_line(e)}") from None
        return self._client

    def get(self, name: str) -> memoryview:
        """The object's bytes, in obstore's own buffer (not copied: a copy costs ~1 s of CPU per GiB here)."""
        import obstore

        return self._call(name, lambda: memoryview(obstore.get(self._store(), name).bytes()))

    def get_ranges(self, ranges: Mapping[str, tuple[Sequence[int], Sequence[int]]]) -> dict[str, list[memoryview]]:
        """Byte ranges of several objects at once: `{name: (starts, lengths)}` -> `{name: [each range's bytes]}`.
        One daemon thread per object, each object's ranges in flight together (obstore: up to 10 requests, ranges less
        than `COALESCE` bytes apart merged). One try, no retries: any failure (a server without range requests
        included) is a StreamError naming the object, and the caller reads the whole object instead."""
        import obstore

        def one(name: str) -> list[memoryview]:
            starts, lengths = ranges[name]
            try:
                got = obstore.get_ranges(self._store(), name, starts=list(starts), lengths=list(lengths),
                                         coalesce=COALESCE)
            except StreamError:
                raise
            except Exception as e:  # obstore's own error types
                raise StreamError(f"{self.url(name)}: range read failed ({_first_line(e)})") from None
            return [memoryview(part) for part in got]

        got: dict[str, list[memoryview] | BaseException] = {}

        def run(name: str) -> None:
            try:
                got[name] = one(name)
            except BaseException as e:  # raised below, in the caller's thread
                got[name] = e

        threads = [threading.Thread(target=run, args=(name,), name="hvdtrain-range", daemon=True) for name in ranges]
        for t in threads:  # daemon threads: a process may exit while one waits on a stalled server
            t.start()
        for t in threads:
            t.join(RANGES_TIMEOUT_S)
        for name in ranges:
            value = got.get(name)
            if isinstance(value, BaseException):
                raise value
            if value is None:
                raise StreamError(f"{self.url(name)}: range read not answered in {RANGES_TIMEOUT_S:.0f} s")
        return got  # type: ignore[return-value]  # every value is a list here

    def put(self, name: str, data: bytes) -> None:
        import obstore

        self._call(name, lambda: obstore.put(self._store(), name, data))

    def _call(self, name: str, op: Callable[[], T]) -> T:
        """`op()`, retried with backoff on transient errors for `retry_s`; StreamError naming the URL."""
        from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError

        url = self.url(name)
        first_failure: float | None = None
        delay = 0.2
        while True:
            try:
                return op()
            except (NotFoundError, FileNotFoundError):
                raise StreamError(f"{url}: not found (404): the dataset lists it but the store does not have it; "
                                  "was the upload complete?") from None
            except (PermissionDeniedError, UnauthenticatedError) as e:
                raise StreamError(f"{url}: access denied ({_first_line(e)}); check the credentials "
                                  "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the bucket's policy)") from None
            except StreamError:
                raise
            except Exception as e:  # obstore raises GenericError (and others) for transient failures
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                if now - first_failure >= self.retry_s:
                    raise StreamError(f"{url}: the store did not answer for {now - first_failure:.0f} s of retries "
                                      f"({_first_line(e)}); is it up and reachable? ({ENV_RETRY} sets how long to "
                                      "retry)") from None
                time.sleep(min(delay * (0.5 + random.random()), max(0.0, self.retry_s - (now - first_failure))))
                delay = min(delay * 2, 5.0)

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}


def open_store(source: str) -> Store:
    """The store of a normalised source (`normalise`)."""
    return RemoteStore(source) if is_url(source) else LocalStore(source)


def _timedelta(seconds: float) -> Any:
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _http_allowed(source: str) -> bool:
    """Plain http: an http:// URL, an http:// S3 endpoint (AWS_ENDPOINT_URL[_S3], AWS_ENDPOINT), AWS_ALLOW_HTTP."""
    endpoints = (os.environ.get(k, "") for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"))
    return (source.startswith("http://") or any(e.startswith("http://") for e in endpoints)
            or os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("true", "1", "yes"))


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
