"""Regenerate tests/fixtures/mosaic/: small MDS datasets written by mosaicml-streaming's own MDSWriter.

hvdtrain does not depend on mosaicml-streaming (it pins numpy<2.2); run this in a separate environment:
    python3 -m venv /tmp/mosaic && /tmp/mosaic/bin/pip install mosaicml-streaming==0.13.0
    /tmp/mosaic/bin/python scripts/make_mosaic_fixtures.py tests/fixtures/mosaic
The expected values are recomputed by tests/stream/test_mds.py from the same seeds (`sample(i)` below is copied there).
"""

import shutil
import sys
from pathlib import Path

import numpy as np
from PIL import Image
from streaming import MDSWriter

COLUMNS = {"x": "ndarray:float32:2,3", "y": "int", "dyn": "ndarray", "name": "str", "blob": "bytes",
           "meta": "json", "f": "float32", "png": "png", "u8": "uint8"}


def sample(i: int) -> dict:
    rng = np.random.default_rng(i)
    img = (rng.integers(0, 256, size=(4, 5, 3))).astype(np.uint8)
    return {"x": rng.standard_normal((2, 3)).astype(np.float32), "y": i * 7 - 3,
            "dyn": np.arange(i + 1, dtype=np.int16).reshape(1, i + 1), "name": f"sample-{i}",
            "blob": bytes(range(i % 7)), "meta": {"i": i, "tags": ["a", str(i)]}, "f": float(i) / 4,
            "png": Image.fromarray(img), "u8": i % 256}


def main(out: Path) -> None:
    for variant, compression in (("raw", None), ("zstd", "zstd:7")):
        target = out / variant
        shutil.rmtree(target, ignore_errors=True)
        with MDSWriter(out=str(target), columns=COLUMNS, compression=compression, hashes=["sha1", "xxh64"],
                       size_limit=2000) as writer:
            for i in range(23):
                writer.write(sample(i))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
