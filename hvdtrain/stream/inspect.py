"""`hvdtrain data inspect PATH`: what an MDS dataset holds, from its index.json files, and how its labels spread
over its shards, from a few of them.

PATH is one MDS directory (its own index.json) or a dataset root whose subdirectories (train/, val/, ...) are MDS
directories, or the URL of either (a URL root's splits are train/ and val/: a store is not listed).
`describe` returns a JSON-able dict; `render` turns it into text.

Labels (NOTE [label spread] in labels.py) are read from at most `LABEL_SHARDS` shards per split, evenly spaced over
its index order: enough to tell a class-sorted split (each shard one or two classes) from a shuffled one, at a
bounded cost. A raw shard on a filesystem is read in place and only its labels column is copied out (the pages
holding it are read: for small samples, most of the shard); a compressed shard or one in a store has to be fetched
whole, so once `LABEL_FETCH_BYTES` have been fetched no more shards are read (at least 2 always are).
`hvdtrain data verify` reads every shard.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from hvdtrain.data.errors import DataError
from hvdtrain.stream import labels, mds, store, verify
from hvdtrain.stream.splits import find_splits, human_bytes

LABEL_SHARDS = 8
LABEL_FETCH_BYTES = 256 << 20


def describe(path: str | Path, label_field: str = labels.DEFAULT_FIELD,
             label_shards: int = LABEL_SHARDS) -> dict[str, Any]:
    """{"path", "layout": "root" | "split", "splits": {name: split description}} (`find_splits`); each split's
    "labels": how column `label_field` spreads over up to `label_shards` of its shards (0: none read)."""
    shown, layout, splits = find_splits(path)
    return {"path": shown, "layout": layout,
            "splits": {name: {**_summary(where, index, missing),
                              "labels": _labels(name, where, index, missing, label_field, label_shards)}
                       for name, (where, index, missing) in splits.items()}}


def _labels(name: str, where: str, index: mds.Index, missing: list[str], field: str, most: int) -> dict[str, Any]:
    """The label spread of up to `most` shards of a split (module docstring), or a note saying why there is none."""
    out: dict[str, Any] = {"field": field}
    note = labels.unusable(dict(index.shards[0].columns), field)
    if note is not None or most <= 0:
        return {**out, "note": note or "not read (--label-shards 0)"}
    source, present = store.open_store(where), [s for s in index.shards if s.remote_file.basename not in missing]
    picks = sorted({int(i) for i in np.linspace(0, len(present) - 1, min(len(present), most)).round()})
    got: list[np.ndarray] = []
    fetched = 0
    for i in picks:
        if fetched >= LABEL_FETCH_BYTES and len(got) >= 2:
            break
        shard = source.url(present[i].remote_file.basename)
        try:
            reader, nbytes = verify.open_shard(source, present[i], check=False)
            try:
                values = labels.shard_labels(reader, field)
            finally:
                reader.close()
        except DataError as e:
            return {**out, "note": f"not read: {e} (`hvdtrain data verify` checks every shard)"}
        fetched += nbytes
        ints = labels.integer_labels(values)
        if ints is None:
            return {**out, "note": f"{shard}: column {field!r} does not hold one integer per sample "
                                   "(`hvdtrain data verify` names the samples)"}
        got.append(ints)
    spread = labels.spread(got)
    if spread is None:
        return {**out, "note": "no samples in the shards read"}
    return {**out, "shards_of": len(index.shards), "fetched_bytes": fetched, **spread,
            "warning": labels.sorted_warning(name, spread, index)}


def _summary(where: str, index: mds.Index, missing: list[str]) -> dict[str, Any]:
    """One split's description from its index (`missing`: shard files listed but absent)."""
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
        lines.append(_render_labels(split["labels"]))
        if split["missing_shards"]:
            lines.append(f"  MISSING {len(split['missing_shards'])} shard file(s) listed in the index: "
                         f"{', '.join(split['missing_shards'][:5])}{' ...' * (len(split['missing_shards']) > 5)}")
    return "\n".join(lines)



def _render_labels(info: dict[str, Any]) -> str:
    if "note" in info:
        return f"  labels ({info['field']}): {info['note']}"
    read = (f"all {info['shards_of']} shards" if info["shards_read"] == info["shards_of"]
            else f"{info['shards_read']} of {info['shards_of']} shards")
    verdict = "; LOOKS SORTED BY CLASS (see the warning)" if info["sorted"] else ""
    return f"  labels ({info['field']}, {read} read): {labels.render(info)}{verdict}"


def warnings(desc: dict[str, Any]) -> list[str]:
    """The warnings of a description (a class-sorted split)."""
    return [split["labels"]["warning"] for split in desc["splits"].values() if split["labels"].get("warning")]
