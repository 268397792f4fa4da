"""`hvdtrain data inspect PATH`: what an MDS dataset holds, from its index.json files only (no shard is read).

PATH is one MDS directory (its own index.json) or a dataset root whose subdirectories (train/, val/, ...) are MDS
directories, or the URL of either (a URL root's splits are train/ and val/: a store is not listed).
`describe` returns a JSON-able dict; `render` turns it into text.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hvdtrain.stream import mds, store
from hvdtrain.stream.errors import StreamError

ORDER = {"train": 0, "val": 1}  # these first, then the other splits by name


def describe(path: str | Path) -> dict[str, Any]:
    """{"path", "layout": "root" | "split", "splits": {name: split description}}; StreamError when `path` is
    neither an MDS directory nor a root of them, or an index is unreadable. A URL (s3://, gs://, http(s)://) is read
    from its store: its own index.json, else those of its train/ and val/."""
    if store.is_url(path):
        return _describe_url(store.normalise(path))
    path = Path(path)
    if not path.is_dir():
        raise StreamError(f"{path}: not a directory; give an MDS dataset directory (with index.json) or a dataset "
                          "root (train/, val/, ...)")
    if (path / mds.INDEX).is_file():
        return {"path": str(path), "layout": "split", "splits": {path.resolve().name: _split(path)}}
    subdirs = sorted((d for d in path.iterdir() if (d / mds.INDEX).is_file()),
                     key=lambda d: (ORDER.get(d.name, len(ORDER)), d.name))
    if not subdirs:
        raise StreamError(f"{path}: no {mds.INDEX} in it or in its subdirectories: not an MDS dataset (write one with "
                          "`hvdtrain data convert SRC DST`)")
    return {"path": str(path), "layout": "root", "splits": {d.name: _split(d) for d in subdirs}}


def _describe_url(url: str) -> dict[str, Any]:
    def index_of(source: str) -> mds.Index | None:
        try:
            text = store.open_store(source).get(mds.INDEX)
        except StreamError as e:
            if "not found (404)" in str(e):
                return None
            raise
        return mds.parse_index(bytes(text).decode("utf-8", errors="replace"), store.join(source, mds.INDEX))

    own = index_of(url)
    if own is not None:
        return {"path": url, "layout": "split", "splits": {url.rsplit("/", 1)[-1]: _summary(url, own, [])}}
    splits = {name: index for name in ORDER if (index := index_of(store.join(url, name))) is not None}
    if not splits:
        raise StreamError(f"{url}: no {mds.INDEX} there or under train/ and val/: not an MDS dataset (upload one "
                          "with `hvdtrain data upload DIR URL`)")
    return {"path": url, "layout": "root",
            "splits": {name: _summary(store.join(url, name), index, []) for name, index in splits.items()}}


def _split(directory: Path) -> dict[str, Any]:
    index_path = directory / mds.INDEX
    try:
        text = index_path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise StreamError(f"{index_path}: cannot read ({e})") from None
    index = mds.parse_index(text, str(index_path))
    missing = [s.remote_file.basename for s in index.shards if not (directory / s.remote_file.basename).is_file()]
    return _summary(str(directory), index, missing)


def _summary(where: str, index: mds.Index, missing: list[str]) -> dict[str, Any]:
    """One split's description (`missing`: shard files listed but absent, checked for local directories only)."""
    shards = index.shards
    hashes = sorted({algo for s in shards for f in (s.raw, s.zip) if f is not None for algo in f.hashes})
    return {
        "path": where,
        "samples": sum(s.samples for s in shards),
        "shards": len(shards),
        "columns": [{"name": name, "encoding": enc.text, "bytes_per_sample": enc.size}
                    for name, enc in shards[0].columns],
        "raw_bytes": sum(s.raw.bytes for s in shards),
        "stored_bytes": sum(s.remote_file.bytes for s in shards),
        "compression": sorted({s.compression or "none" for s in shards}),
        "hashes": hashes,
        "missing_shards": missing,
        "hvdtrain": dict(index.meta),
    }


def human_bytes(n: int) -> str:
    """1536 -> '1.5 KiB'."""
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{int(size)} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def render(desc: dict[str, Any]) -> str:
    """`describe`'s dict as text, one paragraph per split."""
    n = len(desc["splits"])
    what = "MDS dataset root" if desc["layout"] == "root" else "MDS split"
    lines = [f"{desc['path']}: {what}, {n} split{'s' * (n != 1)} ({', '.join(desc['splits'])})"]
    for name, split in desc["splits"].items():
        lines.append(f"{name}: {split['samples']} samples in {split['shards']} shard{'s' * (split['shards'] != 1)}, "
                     f"{human_bytes(split['raw_bytes'])} raw, {human_bytes(split['stored_bytes'])} stored "
                     f"(compression {', '.join(split['compression'])}; hashes {', '.join(split['hashes']) or 'none'})")
        for col in split["columns"]:
            size = "variable size" if col["bytes_per_sample"] is None else f"{col['bytes_per_sample']} B/sample"
            lines.append(f"  column {col['name']}: {col['encoding']} ({size})")
        for key, value in split["hvdtrain"].items():
            if isinstance(value, list) and len(value) > 10:  # e.g. 1000 class names
                value = f"[{', '.join(map(str, value[:10]))}, ... ({len(value)} in all)]"
            lines.append(f"  hvdtrain {key}: {value}")
        if split["missing_shards"]:
            lines.append(f"  MISSING {len(split['missing_shards'])} shard file(s) listed in the index: "
                         f"{', '.join(split['missing_shards'][:5])}{' ...' * (len(split['missing_shards']) > 5)}")
    return "\n".join(lines)
