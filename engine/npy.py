"""numpy arrays as `.npy` bytes: written without pickle, read without pickle.

The reader takes version 1.0 and 2.0 headers (what numpy writes), refuses any dtype that
holds Python objects (reading those needs pickle, which could run code of the writer's
choosing), and checks that the header's shape and dtype describe exactly the bytes that
follow before it makes the array, so a crafted header cannot make it allocate more than it
was given. Only imported where an array is written or read: the core needs no numpy.
"""

from __future__ import annotations

import io
import math
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.lib import format as npy_format

from queryqueue.engine.errors import QueryError

# A structured dtype's header can be long; numpy's own default (10,000) is for files.
MAX_HEADER = 256 * 1024


def is_array(value: Any) -> bool:
    return isinstance(value, np.ndarray)


def plan(array: Any) -> tuple[bytes, memoryview]:
    """The header and the data of `array` as `.npy`: a result's bytes are their two
    lengths, and writing it is two copies."""
    if array.dtype.hasobject:
        raise QueryError(
            f"query result is a numpy array of dtype {array.dtype}, which holds Python "
            "objects: only arrays of plain values travel as .npy (return .tolist() for JSON)"
        )
    if not (array.flags.c_contiguous or array.flags.f_contiguous):
        array = np.ascontiguousarray(array)
    header = io.BytesIO()
    fields = npy_format.header_data_from_array_1_0(array)
    try:
        npy_format.write_array_header_1_0(header, fields)
    except ValueError:  # over 64 KiB: a structured dtype of many fields
        header = io.BytesIO()
        npy_format.write_array_header_2_0(header, fields)
    ordered = array.T if fields["fortran_order"] else array
    return header.getvalue(), memoryview(ordered.reshape(-1).view(np.uint8))


def read(data: memoryview, *, copy: bool) -> Any:
    """The array `data` holds: over `data` itself (read-only) unless `copy`."""
    stream = io.BytesIO(data[: MAX_HEADER + 16])
    try:
        version = npy_format.read_magic(stream)
        read_header = _HEADERS.get(version)
        if read_header is None:
            raise ValueError(f"header version {version} is not one this reader takes")
        shape, fortran_order, dtype = read_header(stream, max_header_size=MAX_HEADER)
    except (ValueError, SyntaxError, TypeError) as exc:
        raise QueryError(f"an .npy result's header is malformed: {exc}") from None
    if dtype.hasobject:
        raise QueryError(
            f"an .npy result of dtype {dtype} is refused: its values are Python objects, "
            "which only pickle could read, and a result never runs code in its reader"
        )
    start = stream.tell()
    count = math.prod(shape)
    if any(dim < 0 for dim in shape) or count * dtype.itemsize != len(data) - start:
        raise QueryError(
            f"an .npy result's header promises shape {shape} of {dtype} "
            f"({count * dtype.itemsize} bytes), and {len(data) - start} bytes follow it"
        )
    if count == 0:
        flat = np.empty(0, dtype=dtype)
    elif dtype.itemsize == 0:
        raise QueryError(f"an .npy result of dtype {dtype} has values of no size")
    else:
        body = bytearray(data[start:]) if copy else data[start:]
        flat = np.frombuffer(body, dtype=dtype, count=count)
    return flat.reshape(shape, order="F" if fortran_order else "C")


_HEADERS: dict[tuple[int, int], Callable[..., tuple[tuple[int, ...], bool, Any]]] = {
    (1, 0): npy_format.read_array_header_1_0,
    (2, 0): npy_format.read_array_header_2_0,
}
