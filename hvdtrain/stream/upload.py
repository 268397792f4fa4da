"""`hvdtrain data upload SRC URL`: copy an MDS dataset (a root of splits, or one split) to an object store.

Every file of each split is put under URL with its path relative to SRC, shards first and each split's index.json
last, so a reader never finds an index whose shards are not all there (a failed upload leaves no index naming
missing shards, unless an older one was there: then re-run the upload). The store is opened as the readers open it
(hvdtrain/stream/store.py: AWS_* environment variables for s3://, an http:// endpoint allowed).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hvdtrain.stream import inspect, mds, store
from hvdtrain.stream.errors import StreamError
from hvdtrain.stream.splits import human_bytes


@dataclass(frozen=True)
class Uploaded:
    url: str
    files: int
    bytes: int


def plan(src: Path) -> list[tuple[Path, str]]:
    """(local file, key relative to the URL) for every file to put, in upload order; StreamError when SRC is not an
    MDS dataset or a shard its index lists is missing (nothing is uploaded then)."""
    desc = inspect.describe(src, label_shards=0)  # the files only: no shard is read
    files: list[tuple[Path, str]] = []
    indexes: list[tuple[Path, str]] = []
    for name, split in desc["splits"].items():
        directory = Path(split["path"])
        if split["missing_shards"]:
            raise StreamError(f"{directory}: shards listed in its index.json are missing: "
                              f"{split['missing_shards'][:5]}; convert it again")
        prefix = "" if desc["layout"] == "split" else f"{name}/"
        index = mds.parse_index((directory / mds.INDEX).read_text(encoding="utf-8"), str(directory / mds.INDEX))
        for shard in index.shards:
            for info in (shard.raw, shard.zip):
                if info is not None and (directory / info.basename).is_file():
                    files.append((directory / info.basename, prefix + info.basename))
        indexes.append((directory / mds.INDEX, prefix + mds.INDEX))
    return files + indexes


def upload(src: Path, url: str, *, progress: bool = True) -> Uploaded:
    if not store.is_url(url):
        raise StreamError(f"{url}: not a URL; give s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or http(s)://...")
    target = store.RemoteStore(store.normalise(url))
    todo = plan(Path(src))
    total = sum(path.stat().st_size for path, _ in todo)
    from tqdm import tqdm

    done = 0
    with tqdm(total=total, unit="B", unit_scale=True, desc="upload", disable=not progress) as bar:
        for path, key in todo:
            data = path.read_bytes()
            target.put(key, data)
            done += len(data)
            bar.update(len(data))
    return Uploaded(target.source, len(todo), done)


def render(result: Uploaded) -> str:
    return (f"uploaded {result.files} files ({human_bytes(result.bytes)}) to {result.url}; train on it with "
            f"--dataset {result.url}")
