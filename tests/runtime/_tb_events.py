"""A TensorBoard event-file reader for tests, independent of the writer (tensorboardX): TFRecord frames (length,
masked CRC-32C, payload, masked CRC-32C) checked with a CRC-32C written out here, payloads decoded as ``Event``
protobufs."""

import struct


def crc32c(data: bytes) -> int:
    crc = 0xFFFFFFFF
    for b in data:
        crc ^= b
        for _ in range(8):
            crc = (crc >> 1) ^ 0x82F63B78 if crc & 1 else crc >> 1
    return crc ^ 0xFFFFFFFF


def masked_crc(data: bytes) -> int:
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _events(path):
    """The ``Event`` protobufs of a TFRecord file, each frame's two CRCs checked."""
    from tensorboardX.proto.event_pb2 import Event

    data, i, out = path.read_bytes(), 0, []
    while i < len(data):
        (length,) = struct.unpack_from("<Q", data, i)
        assert struct.unpack_from("<I", data, i + 8)[0] == masked_crc(data[i:i + 8])
        payload = data[i + 12:i + 12 + length]
        assert struct.unpack_from("<I", data, i + 12 + length)[0] == masked_crc(payload)
        out.append(Event.FromString(payload))
        i += 16 + length
    return out


def read_scalars(logdir):
    """``{(tag, step): value}`` of the one event file in ``logdir``; its first event is the file version and no
    tag appears twice at a step."""
    (path,) = logdir.iterdir()
    assert path.name.startswith("events.out.tfevents.")
    first, *rest = _events(path)
    assert first.file_version == "brain.Event:2"
    out = {}
    for event in rest:
        for value in event.summary.value:
            assert (value.tag, event.step) not in out
            out[value.tag, event.step] = value.simple_value
    return out


def read_scalars_so_far(logdir):
    """:func:`read_scalars`, or None while the file is missing, empty or has a frame half written."""
    try:
        return read_scalars(logdir)
    except (ValueError, AssertionError, struct.error):  # nothing yet, or a frame being written
        return None
