"""TensorBoard's event file, written without TensorFlow or protobuf: TFRecord frames of ``Event``.

The format, declared once here (``tensorflow/core/util/event.proto``, ``summary.proto`` and
``tensorflow/core/lib/io/record_writer.cc``): each record is ``uint64 length``, ``uint32
masked_crc32c(length)``, the bytes, ``uint32 masked_crc32c(bytes)``, little-endian; a record
holds one ``Event`` message, whose fields 3 to 9 are a ``oneof`` (one of them per event). The
fields written:

=================  =====  ===========================================================
``Event``          field  wire
=================  =====  ===========================================================
wall_time          1      fixed64 (double, unix seconds)
step               2      varint (int64)
file_version       3      bytes, ``"brain.Event:2"`` in the first record
summary            5      bytes: ``Summary``, whose field 1 repeats ``Value``
session_log        7      bytes: ``SessionLog``, field 1 ``status`` (varint, START = 1)
``Summary.Value``
tag                1      bytes (UTF-8)
simple_value       2      fixed32 (float)
=================  =====  ===========================================================

>>> hex(crc32c(b"123456789"))  # the CRC-32C check value
'0xe3069283'
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable

__all__ = ["crc32c", "frame", "event"]

FILE_VERSION = b"brain.Event:2"  # readers treat a SessionLog START as a restart from then on
_SESSION_START = 1
_FLOAT_MAX = 3.4028234663852886e38


def _crc_table() -> tuple[int, ...]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1  # Castagnoli, reflected
        table.append(c)
    return tuple(table)


_TABLE = _crc_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``, as TFRecord frames use it."""
    crc = 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def _masked(data: bytes) -> bytes:
    crc = crc32c(data)
    return struct.pack("<I", (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF)


def frame(data: bytes) -> bytes:
    """One TFRecord: length, its masked CRC, ``data``, its masked CRC."""
    head = struct.pack("<Q", len(data))
    return head + _masked(head) + data + _masked(data)


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1  # int64 as protobuf writes it (a negative one takes 10 bytes)
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _scalar(tag: str, value: float) -> bytes:
    v = float(value)
    if math.isfinite(v) and abs(v) > _FLOAT_MAX:
        v = math.copysign(math.inf, v)  # a float32 holds no larger finite number
    return _bytes_field(1, tag.encode()) + b"\x15" + struct.pack("<f", v)


def event(
    wall_time: float,
    step: int,
    scalars: Iterable[tuple[str, float]] = (),
    *,
    file_version: bool = False,
    session_start: bool = False,
) -> bytes:
    """One framed ``Event`` holding one of: ``scalars`` as ``(tag, value)`` summary values
    (float32), the file version (the first record of a file), or a ``SessionLog`` START
    (readers drop what they hold from ``step`` on: a restart)."""
    values = b"".join(_bytes_field(1, _scalar(tag, v)) for tag, v in scalars)
    if bool(values) + file_version + session_start != 1:
        raise ValueError("an Event holds one of scalars, file_version, session_start")
    body = b"\x09" + struct.pack("<d", float(wall_time)) + b"\x10" + _varint(int(step))
    if file_version:
        body += _bytes_field(3, FILE_VERSION)
    elif session_start:
        body += _bytes_field(7, b"\x08" + _varint(_SESSION_START))
    else:
        body += _bytes_field(5, values)
    return frame(body)
