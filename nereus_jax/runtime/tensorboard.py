"""A minimal TensorBoard event-file writer (scalars only), so the job writes TensorBoard logs without
depending on TensorFlow, torch or tensorboardX. Files follow TensorBoard's format: TFRecord frames
(length, masked CRC-32C, payload, masked CRC-32C) of ``Event`` protobufs, encoded by hand."""

from __future__ import annotations

import os
import socket
import struct
import time

_CRC_TABLE = []
for _i in range(256):
    _c = _i
    for _ in range(8):
        _c = (_c >> 1) ^ 0x82F63B78 if _c & 1 else _c >> 1
    _CRC_TABLE.append(_c)


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc = _CRC_TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _bytes_field(number: int, data: bytes) -> bytes:
    return _field(number, 2, _varint(len(data)) + data)


def encode_event(wall_time: float, step: int, *, scalars: dict[str, float] | None = None,
                 file_version: str | None = None) -> bytes:
    """An ``Event`` protobuf: wall_time (1, double), step (2, int64), file_version (3) or summary (5)."""
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalars:
        values = b"".join(_bytes_field(1, _bytes_field(1, tag.encode()) + _field(2, 5, struct.pack("<f", v)))
                          for tag, v in scalars.items())
        out += _bytes_field(5, values)
    return out


class EventWriter:
    """Appends scalar summaries to ``log_dir/events.out.tfevents.<time>.<host>``."""

    def __init__(self, log_dir: str):
        os.makedirs(log_dir, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time())}.{socket.gethostname()}"
        self.path = os.path.join(log_dir, name)
        self._file = open(self.path, "ab")  # noqa: SIM115 - closed by close()
        self._write(encode_event(time.time(), 0, file_version="brain.Event:2"))

    def scalars(self, step: int, values: dict[str, float]) -> None:
        self._write(encode_event(time.time(), step, scalars={k: float(v) for k, v in values.items()}))
        self._file.flush()

    def close(self) -> None:
        self._file.close()

    def _write(self, record: bytes) -> None:
        header = struct.pack("<Q", len(record))
        self._file.write(header + struct.pack("<I", masked_crc(header)) + record
                         + struct.pack("<I", masked_crc(record)))
