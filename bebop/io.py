"""Reading and writing run files so that damage is named, not a bare numpy/json traceback.

`load_array` checks a `.npy` file's header against its size before numpy reads it (a truncated
`tokens.npy` otherwise fails with "cannot reshape array", a corrupt one with numpy's advice about
`allow_pickle`). `read_json` names the file and the position of a JSON error. `write_json_atomic`
and `save_array_atomic` write to a temporary file and rename it, so a crash leaves the old file
or the new one, never half of one.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np


class DamagedFileError(ValueError):
    """A run file is missing, truncated or malformed; the message names the file."""


def load_array(path, ndim: int | None = None, kind: str | None = None, mmap: bool = False):
    """The array in `path` (a `.npy` file), checked: readable header, no pickled objects, as many
    data bytes as the header promises, and (when given) `ndim` dimensions and a dtype of numpy
    `kind` ('i' signed int, 'u', 'f', 'b'). `mmap=True` maps it read-only."""
    path = Path(path)
    if not path.is_file():
        raise DamagedFileError(f"{path}: file not found")
    size = path.stat().st_size
    with path.open("rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(version)
            if read_header is None:
                raise ValueError(f"unsupported .npy version {version}")
            shape, fortran, dtype = read_header(f)
        except (ValueError, OSError, SyntaxError, EOFError) as e:
            raise DamagedFileError(f"{path}: not a readable .npy file ({e})") from e
        offset = f.tell()
    if dtype.hasobject:
        raise DamagedFileError(f"{path}: holds Python objects (pickle); expected a numeric array")
    expected = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if size - offset != expected:
        raise DamagedFileError(
            f"{path}: truncated or padded: the header says shape {shape} {dtype} "
            f"({expected} data bytes) but the file has {size - offset}"
        )
    if ndim is not None and len(shape) != ndim:
        raise DamagedFileError(f"{path}: expected {ndim} dimensions, got shape {shape}")
    if kind is not None and dtype.kind not in kind:
        raise DamagedFileError(f"{path}: expected dtype kind {kind!r}, got {dtype}")
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError) as e:  # header passed, data unreadable (e.g. an I/O error)
        raise DamagedFileError(f"{path}: unreadable array data ({e})") from e


def save_array_atomic(path, array) -> None:
    path = Path(path)
    tmp = path.with_name(path.stem + ".tmp.npy")
    np.save(tmp, np.asarray(array), allow_pickle=False)
    os.replace(tmp, path)


def read_json(path):
    """The JSON value in `path`; an empty, cut-off or non-UTF-8 file raises `DamagedFileError`
    naming the file, line and column."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except FileNotFoundError as e:
        raise DamagedFileError(f"{path}: file not found") from e
    except UnicodeDecodeError as e:
        raise DamagedFileError(f"{path}: not UTF-8 (byte {e.start}: {e.reason})") from e
    if not text.strip():
        raise DamagedFileError(f"{path}: empty file (expected JSON)")
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DamagedFileError(
            f"{path}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}"
        ) from e


def write_json_atomic(path, obj, indent: int | None = 2) -> None:
    """`obj` as JSON in `path`, written to a temporary file beside it and renamed over it: a
    write cut off midway leaves the previous file, and no temporary one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(json.dumps(obj, indent=indent, sort_keys=False) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
