"""MDS column encodings (mosaicml/streaming's names and byte layouts), decoded to numpy arrays.

A column's encoding is a string from the shard's index: `ndarray[:dtype[:d0,d1,...]]`, a scalar type (`uint8` ...
`float64`, `int` = int64), `str`, `bytes`, `json`, `str_int`, `str_float`, `str_decimal`, or an image (`jpeg`,
`png`, `pil`; decoded with Pillow to a uint8 H×W×C array). Pickled columns (`pkl`) are refused: unpickling a
downloaded shard runs its code.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from hvdtrain.stream.errors import StreamError

SCALARS = {name: np.dtype(name) for name in ("uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32",
                                             "int64", "float16", "float32", "float64")}
# ndarray's dynamic-dtype byte (Mosaic's table) and its dynamic-shape dtypes.
VALUE_DTYPES = {8: "uint8", 9: "int8", 16: "uint16", 17: "int16", 18: "float16", 32: "uint32", 33: "int32",
                34: "float32", 64: "uint64", 65: "int64", 66: "float64"}
DTYPE_CODES = {v: k for k, v in VALUE_DTYPES.items()}
SHAPE_DTYPES = {0: "uint8", 1: "uint16", 2: "uint32", 3: "uint64"}
TEXT = ("str", "bytes", "json", "str_int", "str_float", "str_decimal")
IMAGES = ("jpeg", "png", "pil")
IMAGE_FILES = ("jpeg", "png")  # encoded image files: the loaders decode and augment them per batch (images.py)
KNOWN = (*SCALARS, "int", "ndarray", *TEXT, *IMAGES)


class EncodingError(StreamError):
    """A column encoding this reader does not support, or a value that does not fit its encoding."""


@dataclass(frozen=True)
class Encoding:
    """One column's parsed encoding: `kind` is 'scalar', 'ndarray', 'text' or 'image'."""

    text: str
    kind: str
    dtype: np.dtype | None = None  # scalar / ndarray with a static dtype
    shape: tuple[int, ...] | None = None  # ndarray with a static shape

    @property
    def size(self) -> int | None:
        """Bytes per sample when fixed (MDS's column_sizes), else None."""
        if self.kind == "scalar":
            return self.dtype.itemsize if self.dtype is not None else None
        if self.kind == "ndarray" and self.dtype is not None and self.shape is not None:
            return int(np.prod(self.shape)) * self.dtype.itemsize
        return None

    @property
    def array_like(self) -> bool:
        """Decodes to a numeric array (batchable by stacking)."""
        return self.kind in ("scalar", "ndarray", "image")


def parse(text: str) -> Encoding:
    """The encoding named by `text`, or EncodingError listing what is supported."""
    name, _, rest = text.partition(":")
    if name == "int" and not rest:
        return Encoding(text, "scalar", np.dtype("int64"))
    if name in SCALARS and not rest:
        return Encoding(text, "scalar", SCALARS[name])
    if name in TEXT and not rest:
        return Encoding(text, "text")
    if name in IMAGES:
        return Encoding(text, "image")
    if name == "ndarray":
        return _parse_ndarray(text, rest)
    if name == "pkl":
        raise EncodingError("column encoding 'pkl' is not read: unpickling a shard runs code from whoever wrote "
                            "it; re-write the column as 'ndarray' or 'bytes'")
    raise EncodingError(f"unknown column encoding {text!r}; supported: {', '.join(KNOWN)} "
                        f"(ndarray may be 'ndarray:DTYPE' or 'ndarray:DTYPE:D0,D1,...')")


def _parse_ndarray(text: str, rest: str) -> Encoding:
    parts = rest.split(":") if rest else []
    if len(parts) > 2:
        raise EncodingError(f"bad ndarray encoding {text!r}: expected ndarray[:DTYPE[:D0,D1,...]]")
    dtype = shape = None
    if parts:
        if parts[0] not in DTYPE_CODES:
            raise EncodingError(f"bad ndarray encoding {text!r}: dtype {parts[0]!r} is not one of "
                                f"{sorted(DTYPE_CODES)}")
        dtype = np.dtype(parts[0])
    if len(parts) == 2:
        try:
            shape = tuple(int(d) for d in parts[1].split(","))
        except ValueError:
            shape = ()
        if not shape or min(shape) < 1:
            raise EncodingError(f"bad ndarray encoding {text!r}: shape {parts[1]!r} must be positive integers "
                                "separated by commas")
    return Encoding(text, "ndarray", dtype, shape)


def decode(enc: Encoding, data: memoryview | bytes) -> Any:
    """One column value of one sample. Arrays may view `data` (no copy): copy before `data` goes away."""
    if enc.kind == "scalar":
        return np.frombuffer(data, enc.dtype, count=1)[0]
    if enc.kind == "ndarray":
        return _decode_ndarray(enc, data)
    if enc.kind == "image":
        return _decode_image(enc, data)
    raw = bytes(data)
    name = enc.text
    if name == "bytes":
        return raw
    value = raw.decode("utf-8")
    if name == "json":
        return json.loads(value)
    if name == "str_int":
        return int(value)
    if name == "str_float":
        return float(value)
    if name == "str_decimal":
        from decimal import Decimal

        return Decimal(value)
    return value


def _decode_ndarray(enc: Encoding, data: memoryview | bytes) -> np.ndarray:
    pos = 0
    dtype = enc.dtype
    if dtype is None:
        code = data[0]
        if code not in VALUE_DTYPES:
            raise EncodingError(f"ndarray value has dtype code {code}, not one of {sorted(VALUE_DTYPES)}")
        dtype, pos = np.dtype(VALUE_DTYPES[code]), 1
    shape = enc.shape
    if shape is None:
        byte = data[pos]
        ndim, shape_dtype = byte >> 2, np.dtype(SHAPE_DTYPES[byte & 3])
        shape = tuple(int(d) for d in np.frombuffer(data, shape_dtype, count=ndim, offset=pos + 1))
        pos += 1 + ndim * shape_dtype.itemsize
    count = int(np.prod(shape))
    if (len(data) - pos) != count * dtype.itemsize:
        raise EncodingError(f"ndarray value holds {len(data) - pos} bytes; shape {shape} of {dtype} needs "
                            f"{count * dtype.itemsize}")
    return np.frombuffer(data, dtype, count=count, offset=pos).reshape(shape)


def _decode_image(enc: Encoding, data: memoryview | bytes) -> np.ndarray:
    from PIL import Image

    if enc.text == "pil":
        width, height, mode_len = (int(v) for v in np.frombuffer(data, np.uint32, count=3))
        mode = bytes(data[12:12 + mode_len]).decode("utf-8")
        image = Image.frombytes(mode, (width, height), bytes(data[12 + mode_len:]))
    else:
        image = Image.open(io.BytesIO(data))
        image.load()
    array = np.asarray(image)
    return array[:, :, None] if array.ndim == 2 else array


def encode(enc: Encoding, value: Any) -> bytes:
    """`value` as column bytes (the writer's side; arrays and scalars only are needed by hvdtrain's converter)."""
    if enc.kind == "scalar":
        try:
            return np.array(value, dtype=enc.dtype).tobytes()
        except (OverflowError, ValueError, TypeError) as e:
            raise EncodingError(f"value {value!r} does not fit a {enc.text} column ({e})") from None
    if enc.kind == "ndarray":
        return _encode_ndarray(enc, np.asarray(value))
    if enc.text == "bytes":
        return bytes(value)
    if enc.text == "json":
        return json.dumps(value).encode("utf-8")
    if enc.kind == "text":
        return str(value).encode("utf-8")
    if enc.text in ("jpeg", "png"):
        return bytes(value)  # already-encoded image files (the converter copies them unchanged)
    raise EncodingError(f"hvdtrain does not write {enc.text!r} columns")


def _encode_ndarray(enc: Encoding, arr: np.ndarray) -> bytes:
    if arr.dtype.name not in DTYPE_CODES:
        raise EncodingError(f"ndarray dtype {arr.dtype} cannot be stored; use one of {sorted(DTYPE_CODES)}")
    if arr.size == 0:
        raise EncodingError("an MDS ndarray value needs at least one element")
    parts = []
    if enc.dtype is None:
        parts.append(bytes([DTYPE_CODES[arr.dtype.name]]))
    elif arr.dtype != enc.dtype:
        raise EncodingError(f"value has dtype {arr.dtype}, the column {enc.text!r} holds {enc.dtype}")
    if enc.shape is None:
        top = max(arr.shape)
        code = 0 if top < 1 << 8 else 1 if top < 1 << 16 else 2 if top < 1 << 32 else 3
        parts.append(bytes([(arr.ndim << 2) | code]))
        parts.append(np.asarray(arr.shape, SHAPE_DTYPES[code]).tobytes())
    elif arr.shape != enc.shape:
        raise EncodingError(f"value has shape {arr.shape}, the column {enc.text!r} holds {enc.shape}")
    parts.append(np.ascontiguousarray(arr).tobytes())
    return b"".join(parts)


def ndarray_encoding(arr: np.ndarray) -> str:
    """The static encoding of samples shaped and typed like `arr` (one sample)."""
    if arr.ndim == 0:
        return "int64" if arr.dtype.kind in "iu" and arr.dtype.name not in SCALARS else arr.dtype.name
    return f"ndarray:{arr.dtype.name}:{','.join(str(d) for d in arr.shape)}"
