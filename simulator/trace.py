"""Chrome trace (Perfetto, chrome://tracing) export: one process per device, a lane per stream,
named with metadata events, and the device's memory as a counter track."""

from __future__ import annotations

import gzip
import json

from pipescope.simulator.files import write_atomic
from pipescope.simulator.result import SimResult

KIND_NAMES = {"F": "forward", "I": "input-grad", "W": "weight-grad", "B": "backward",
              "SEND_F": "send activation", "SEND_B": "send gradient",
              "RECV_F": "receive activation", "RECV_B": "receive gradient"}


def _lanes(result: SimResult) -> dict[tuple[int, str], int]:
    """Thread id per (device, stream): compute first, then send streams by peer."""
    lanes: dict[tuple[int, str], int] = {}
    frame = result.timeline
    streams = set(zip(frame["device"], frame["stream"]))
    for device, stream in sorted(streams, key=lambda k: (k[0], k[1] != "compute", k[1])):
        lanes[(device, stream)] = sum(1 for d, _ in lanes if d == device)
    return lanes


def _metadata(result: SimResult, lanes: dict[tuple[int, str], int]) -> list[dict]:
    events = []
    for d in range(result.schedule.num_devices):
        events.append({"ph": "M", "name": "process_name", "pid": d, "args": {"name": f"device {d}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": d, "args": {"sort_index": d}})
    for (d, stream), tid in lanes.items():
        events.append({"ph": "M", "name": "thread_name", "pid": d, "tid": tid, "args": {"name": stream}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": d, "tid": tid, "args": {"sort_index": tid}})
    return events


def _op_events(result: SimResult, lanes: dict[tuple[int, str], int]) -> list[dict]:
    frame = result.timeline
    columns = zip(frame["device"], frame["stream"], frame["action"], frame["kind"], frame["chunk"],
                  frame["microbatch"], frame["stage"], frame["start_ns"], frame["end_ns"])
    return [{
        "ph": "X", "pid": int(d), "tid": lanes[(d, stream)], "name": f"{kind}{mb}" + (f" c{chunk}" if chunk else ""),
        "cat": KIND_NAMES.get(kind, kind), "ts": start / 1e3, "dur": (end - start) / 1e3,
        "args": {"action": action, "stage": int(stage), "chunk": int(chunk), "microbatch": int(mb)},
    } for d, stream, action, kind, chunk, mb, stage, start, end in columns]


def _memory_events(result: SimResult) -> list[dict]:
    events = []
    for d, mem in enumerate(result.memory):
        for t, used in zip(mem.times.tolist(), mem.bytes_in_use.tolist()):
            events.append({"ph": "C", "pid": d, "name": "memory", "ts": t / 1e3, "args": {"GiB": used / 2**30}})
    return events


def chrome_trace(result: SimResult) -> dict:
    """The trace as a JSON-ready dict (timestamps in microseconds)."""
    lanes = _lanes(result)
    events = _metadata(result, lanes) + _op_events(result, lanes) + _memory_events(result)
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schedule": result.schedule.name}}


def write_trace(result: SimResult, path: str) -> None:
    """Write the trace atomically; gzip-compressed when the name ends in ``.gz``."""
    data = json.dumps(chrome_trace(result), separators=(",", ":")).encode()
    write_atomic(path, gzip.compress(data, compresslevel=6) if path.lower().endswith(".gz") else data)
