"""TensorBoard scalars read back from the event files a run writes."""

import struct


def tensorboard_events(logdir):
    """Every Event in the tensorboardX event files under logdir. Parses the TFRecord framing by
    hand (u64 length, u32 crc, payload, u32 crc): tensorboard itself is not a dependency."""
    from tensorboardX.proto.event_pb2 import Event

    found = []
    for path in sorted(logdir.rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            found.append(Event.FromString(data[pos + 12 : pos + 12 + n]))
            pos += 12 + n + 4
    return found


def event_tags(logdir):
    """{tag: [(step, value), ...]} of the scalars under logdir."""
    tags = {}
    for event in tensorboard_events(logdir):
        for v in event.summary.value:
            tags.setdefault(v.tag, []).append((event.step, v.simple_value))
    return tags
