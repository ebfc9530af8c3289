"""The event writer produces TFRecord frames with valid CRCs and decodable scalar events."""

import struct

from nereus_jax.runtime.tensorboard import EventWriter, crc32c, masked_crc


def _records(path):
    with open(path, "rb") as f:
        data = f.read()
    i, out = 0, []
    while i < len(data):
        (length,) = struct.unpack_from("<Q", data, i)
        assert struct.unpack_from("<I", data, i + 8)[0] == masked_crc(data[i:i + 8])
        payload = data[i + 12:i + 12 + length]
        assert struct.unpack_from("<I", data, i + 12 + length)[0] == masked_crc(payload)
        out.append(payload)
        i += 16 + length
    return out


def test_crc32c_matches_the_standard_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value of RFC 3720


def test_event_file_holds_version_then_scalars(tmp_path):
    w = EventWriter(str(tmp_path))
    w.scalars(3, {"reward_mean": 0.5, "kl": 0.25})
    w.close()
    first, second = _records(w.path)
    assert b"brain.Event:2" in first
    assert b"reward_mean" in second and struct.pack("<f", 0.5) in second and struct.pack("<f", 0.25) in second
    assert second[9:11] == bytes([0x10, 3])  # step field (2, varint) = 3, right after the 9-byte wall_time
