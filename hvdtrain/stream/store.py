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
last error and how long it was retried; a retry prints one line to stderr (`hvdtrain: retrying URL (try 2; 0 of
120 s spent) after ...`), at most one per RETRY_LINE_EVERY_S per process. A bucket that does not exist (S3's
NoSuchBucket, also a 404) is said so, naming the bucket and the endpoint. Every error is a StreamError.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from hvdtrain.data.errors import DataError
from hvdtrain.stream.errors import StreamError

if TYPE_CHECKING:
    from datetime import timedelta

    from obstore.store import ClientConfig, RetryConfig

REMOTE_SCHEMES = ("s3", "gs", "http", "https")
ENV_RETRY = "HVDTRAIN_STREAM_RETRY_S"
DEFAULT_RETRY_S = 120.0
COALESCE = 16 << 10  # get_ranges: ranges closer than this are one request (adjacent rows of a shard)
RANGES_TIMEOUT_S = 150.0  # get_ranges waits this long for its threads (obstore's own request timeout is 120 s)
ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT")  # S3-compatible servers, first set wins
NOT_FOUND = "not found (404)"  # in the message of a missing object (hvdtrain/train/streamed.py: a missing split)
RETRY_LINE_EVERY_S = 10.0  # at most one "retrying" line per process this often (_say_retry)
T = TypeVar("T")
_retry_line_lock = threading.Lock()
_last_retry_line = -math.inf


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

            options: ClientConfig = {"connect_timeout": "5s", "timeout": "120s"}
            if _http_allowed(self.source):  # passing client_options makes obstore ignore AWS_ALLOW_HTTP
                options["allow_http"] = True
            # Few retries inside obstore: the deadline and the error message are ours (get()).
            retry: RetryConfig = {"max_retries": 1, "retry_timeout": _timedelta(5.0)}
            try:
                self._client = from_url(self.source, client_options=options, retry_config=retry)
            except Exception as e:  # obstore's configuration errors are its own types
                raise StreamError(f"{self.source}: cannot open this store: {_first_line(e)}") from None
        return self._client

    def get(self, name: str) -> memoryview:
        """The object's bytes, in obstore's own buffer (not copied: the copy's page faults cost as much CPU as s3fs's
        whole download path: docs/performance.md, "Transport")."""
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
            except DataError:
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
        """`op()`, retried with backoff on transient errors for `retry_s` (one line on stderr per retry); StreamError
        naming the URL (and the bucket and endpoint when the bucket does not exist)."""
        from obstore.exceptions import NotFoundError, PermissionDeniedError, UnauthenticatedError

        url = self.url(name)
        first_failure: float | None = None
        delay = 0.2
        tries = 1
        while True:
            try:
                return op()
            except (NotFoundError, FileNotFoundError) as e:
                if self.source.startswith(("s3://", "gs://")) and _no_bucket(e):
                    raise StreamError(self._no_bucket_message(url, e)) from None
                raise StreamError(f"{url}: {NOT_FOUND}: the dataset lists it but the store does not have it; "
                                  "was the upload complete?") from None
            except (PermissionDeniedError, UnauthenticatedError) as e:
                raise StreamError(f"{url}: access denied ({_first_line(e)}); check the credentials "
                                  "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY or the bucket's policy)") from None
            except DataError:
                raise
            except Exception as e:  # obstore raises GenericError (and others) for transient failures
                now = time.monotonic()
                first_failure = now if first_failure is None else first_failure
                if now - first_failure >= self.retry_s:
                    raise StreamError(f"{url}: the store did not answer for {now - first_failure:.0f} s of retries "
                                      f"({_first_line(e)}); is it up and reachable? ({ENV_RETRY} sets how long to "
                                      "retry)") from None
                tries += 1
                _say_retry(f"hvdtrain: retrying {url} (try {tries}; {now - first_failure:.0f} of {self.retry_s:g} s "
                           f"spent) after {_summary(e)}")
                time.sleep(min(delay * (0.5 + random.random()), max(0.0, self.retry_s - (now - first_failure))))
                delay = min(delay * 2, 5.0)

    def _no_bucket_message(self, url: str, e: BaseException) -> str:
        """The store's bucket does not exist: name it, the endpoint asked, and the two fixes."""
        scheme, _, rest = self.source.partition("://")
        bucket = rest.split("/", 1)[0]
        endpoint, how = _endpoint(e, scheme)
        create = (f"`aws s3 mb s3://{bucket}" + (f" --endpoint-url {endpoint}`" if how else "`")
                  if scheme == "s3" else f"`gcloud storage buckets create gs://{bucket}`")
        return (f"{url}: the bucket {bucket!r} does not exist at {endpoint}{how} (404 NoSuchBucket); create it "
                f"({create}) or check the bucket name in the URL"
                + (f" and the endpoint ({' / '.join(ENDPOINT_VARS[:2])})" if scheme == "s3" else ""))

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_client": None}


def open_store(source: str) -> Store:
    """The store of a normalised source (`normalise`)."""
    return RemoteStore(source) if is_url(source) else LocalStore(source)


def _timedelta(seconds: float) -> timedelta:
    from datetime import timedelta

    return timedelta(seconds=seconds)


def _http_allowed(source: str) -> bool:
    """Plain http: an http:// URL, an http:// S3 endpoint (AWS_ENDPOINT_URL[_S3], AWS_ENDPOINT), AWS_ALLOW_HTTP."""
    endpoints = (os.environ.get(k, "") for k in ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"))
    return (source.startswith("http://") or any(e.startswith("http://") for e in endpoints)
            or os.environ.get("AWS_ALLOW_HTTP", "").lower() in ("true", "1", "yes"))


def _no_bucket(e: BaseException) -> bool:
    """A 404 because the bucket itself is missing (S3's and GCS's NoSuchBucket), not an object in it."""
    text = str(e)
    return "NoSuchBucket" in text or "bucket does not exist" in text.lower()


def _endpoint(e: BaseException, scheme: str) -> tuple[str, str]:
    """(the endpoint a request went to, where it came from: ' (AWS_ENDPOINT_URL)' or '' for the default)."""
    asked = re.search(r"Error performing \w+ (\w+://[^/\s]+)", str(e))
    for var in ENDPOINT_VARS if scheme == "s3" else ():
        if os.environ.get(var):
            return (asked.group(1) if asked else os.environ[var].rstrip("/")), f" ({var})"
    if asked:
        return asked.group(1), ""
    return ("AWS's default endpoint (no AWS_ENDPOINT_URL set)" if scheme == "s3" else f"{scheme}'s default "
            "endpoint"), ""


def _summary(e: BaseException) -> str:
    """A transient error in a few words: `HTTP 503 Service Unavailable`, `Connection refused`, or its first line."""
    text = str(e)
    status = re.search(r"status code: (\d{3}[^:\n]*)", text)
    if status:
        return f"HTTP {status.group(1).strip()}"
    os_error = re.search(r'message: "([^"]+)"', text)
    if os_error:
        return os_error.group(1)
    line = _first_line(e)
    return line.rsplit(" - ", 1)[-1].strip() or line


def _say_retry(line: str) -> None:
    """A retry line, at most one per RETRY_LINE_EVERY_S per process: every fetch thread and producer of a node
    retries the same outage, and a line from each, for each try, would bury the console."""
    global _last_retry_line
    with _retry_line_lock:
        now = time.monotonic()
        if now - _last_retry_line < RETRY_LINE_EVERY_S:
            return
        _last_retry_line = now
    with contextlib.suppress(OSError, ValueError, AttributeError):  # a closed stderr must not end the retrying
        _say(line)


def _say(line: str) -> None:
    """One line to stderr in one write (mpirun tags what it reads: two writes could be split by another rank's)."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
