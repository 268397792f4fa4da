"""Where an MDS dataset's splits are and their indexes (`find_splits`), for `hvdtrain data inspect`, `verify` and
`upload`; and how their sizes are written (`human_bytes`). Reads index.json files only."""

from __future__ import annotations

from pathlib import Path

from hvdtrain.data.errors import DataError
from hvdtrain.stream import mds, store
from hvdtrain.stream.errors import StreamError

ORDER = {"train": 0, "val": 1}  # these first, then the other splits by name


def find_splits(path: str | Path) -> tuple[str, str, dict[str, tuple[str, mds.Index, list[str]]]]:
    """(the dataset as named, "root" | "split", {split name: (its directory or URL, its index, shard files listed
    but absent)}); StreamError when `path` is neither an MDS directory nor a root of them, or an index is
    unreadable. A URL (s3://, gs://, http(s)://) is read from its store: its own index.json, else those of its
    train/ and val/ (absent shards are checked for local directories only)."""
    if store.is_url(path):
        return _find_url(store.normalise(path))
    path = Path(path)
    if not path.is_dir():
        raise StreamError(f"{path}: not a directory; give an MDS dataset directory (with index.json) or a dataset "
                          "root (train/, val/, ...)")
    if (path / mds.INDEX).is_file():
        return str(path), "split", {path.resolve().name: _split(path)}
    subdirs = sorted((d for d in path.iterdir() if (d / mds.INDEX).is_file()),
                     key=lambda d: (ORDER.get(d.name, len(ORDER)), d.name))
    if not subdirs:
        raise StreamError(f"{path}: no {mds.INDEX} in it or in its subdirectories: not an MDS dataset (write one with "
                          "`hvdtrain data convert SRC DST`)")
    return str(path), "root", {d.name: _split(d) for d in subdirs}


def _find_url(url: str) -> tuple[str, str, dict[str, tuple[str, mds.Index, list[str]]]]:
    def index_of(source: str) -> mds.Index | None:
        try:
            text = store.open_store(source).get(mds.INDEX)
        except DataError as e:
            if store.NOT_FOUND in str(e):
                return None
            raise
        return mds.parse_index(bytes(text).decode("utf-8", errors="replace"), store.join(source, mds.INDEX))

    own = index_of(url)
    if own is not None:
        return url, "split", {url.rsplit("/", 1)[-1]: (url, own, [])}
    splits = {name: index for name in ORDER if (index := index_of(store.join(url, name))) is not None}
    if not splits:
        raise StreamError(f"{url}: no {mds.INDEX} there or under train/ and val/: not an MDS dataset (upload one "
                          "with `hvdtrain data upload DIR URL`)")
    return url, "root", {name: (store.join(url, name), index, []) for name, index in splits.items()}


def _split(directory: Path) -> tuple[str, mds.Index, list[str]]:
    index_path = directory / mds.INDEX
    try:
        text = index_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StreamError(f"{index_path}: cannot read ({e})") from None
    index = mds.parse_index(text, str(index_path))
    missing = [s.remote_file.basename for s in index.shards if not (directory / s.remote_file.basename).is_file()]
    return str(directory), index, missing


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")
