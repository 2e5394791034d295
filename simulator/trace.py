"""Chrome trace (Perfetto, chrome://tracing) export: one process per device, a lane per stream (compute, sends,
receives, collectives), named with metadata events, the device's memory as a counter track, and a ``network``
process with a lane per busiest link showing when it carried traffic."""

from __future__ import annotations

import gzip
import json

import numpy as np

from pipescope.simulator.readers.files import write_atomic
from pipescope.simulator.ir import KINDS, Collective
from pipescope.simulator.result import SimResult

KIND_NAMES = {kind.value: facts.name for kind, facts in KINDS.items()}  # a trace event's category


def _lane_names(result: SimResult) -> list[str]:
    """Each row's lane: its stream, except that overlapping collectives (a stage's buckets run concurrently) go to
    ``collective``, ``collective 2``, ...: X events on one thread must nest, and Perfetto drops those that do not."""
    frame = result.timeline
    names = frame["stream"].tolist()
    device, start, end = (frame[column].to_numpy() for column in ("device", "start_ns", "end_ns"))
    rows = np.flatnonzero(frame["stream"].to_numpy() == "collective")
    ends: dict[int, list[int]] = {}  # per device, when each collective lane frees up
    for i in rows[np.argsort(start[rows], kind="stable")].tolist():
        free = ends.setdefault(int(device[i]), [])
        k = next((k for k, busy_until in enumerate(free) if busy_until <= start[i]), len(free))
        free[k:k + 1] = [int(end[i])]
        names[i] = "collective" if k == 0 else f"collective {k + 1}"
    return names


def _lane_order(stream: str) -> tuple[bool, str, int]:
    """Compute first, then the rest by name, numbered lanes in numeric order (collective 2 before collective 10)."""
    base, _, number = stream.partition(" ")
    return stream != "compute", base, int(number) if number.isdigit() else 1


def _lanes(result: SimResult, names: list[str]) -> dict[tuple[int, str], int]:
    """Thread id per (device, lane): compute first, then collectives and streams by peer."""
    per_device: dict[int, list[str]] = {}
    for device, lane in set(zip(result.timeline["device"].tolist(), names)):
        per_device.setdefault(device, []).append(lane)
    return {(device, lane): tid for device in sorted(per_device)
            for tid, lane in enumerate(sorted(per_device[device], key=_lane_order))}


def _metadata(result: SimResult, lanes: dict[tuple[int, str], int]) -> list[dict]:
    events = []
    for d in range(result.records.num_devices):
        events.append({"ph": "M", "name": "process_name", "pid": d, "args": {"name": f"device {d}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": d, "args": {"sort_index": d}})
    for (d, stream), tid in lanes.items():
        events.append({"ph": "M", "name": "thread_name", "pid": d, "tid": tid, "args": {"name": stream}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": d, "tid": tid, "args": {"sort_index": tid}})
    return events


def _op_events(result: SimResult, names: list[str], lanes: dict[tuple[int, str], int]) -> list[dict]:
    frame = result.timeline
    # The chunk from the pipeline's own device count: the frame's column divides by every replica's devices.
    chunks = (frame["stage"] // max(1, result.schedule.num_devices)).tolist()
    columns = zip(frame["device"], names, frame["action"], frame["kind"], chunks, frame["microbatch"],
                  frame["stage"], frame["start_ns"], frame["end_ns"], result.records.actions)
    events = []
    for d, lane, action, kind, chunk, mb, stage, start, end, op in columns:
        name = f"{kind}{mb}" + (f" c{chunk}" if chunk else "")
        events.append({
            "ph": "X", "pid": int(d), "tid": lanes[(d, lane)], "name": name,
            "cat": KIND_NAMES.get(kind, kind), "ts": start / 1e3, "dur": (end - start) / 1e3,
            "args": {"action": action, "stage": int(stage), "chunk": int(chunk), "microbatch": int(mb)},
        })
        if isinstance(op, Collective):
            _name_collective(events[-1], op)
    return events


def _name_collective(event: dict, op: Collective) -> None:
    """A collective reads by what it does, not by its action code: 'all-reduce stage 3 bucket 2', or for the one of no
    stage (clipping's, ``lowering.NORM_BYTES``) 'all-reduce gradient norm'."""
    event["name"] = f"{event['cat']} stage {op.stage} bucket {op.bucket}" if op.stage >= 0 else \
        f"{event['cat']} gradient norm"
    event["args"].update(bytes=int(op.nbytes), bucket=op.bucket, members=len(op.group))


def _link_events(result: SimResult) -> list[dict]:
    """The ``network`` process after the devices: a lane per link in ``link_spans``, an event per busy span
    (never per flow, which would make the file grow with the traffic)."""
    if not result.link_spans:
        return []
    pid = result.records.num_devices
    events = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": "network"}},
              {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}}]
    for tid, (link, spans) in enumerate(result.link_spans.items()):
        events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": link}})
        events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
        events += [{"ph": "X", "pid": pid, "tid": tid, "name": "busy", "cat": "link", "ts": start / 1e3,
                    "dur": (end - start) / 1e3} for start, end in spans]
    return events


STALL = "stall"  # the category of an op's wait between its units (ZeRO-3's gathers), inside the op's own event


def _stall_events(result: SimResult, lanes: dict[tuple[int, str], int]) -> list[dict]:
    """Each wait of an op run unit by unit, nested in its op on the device's compute thread."""
    return [{"ph": "X", "pid": int(d), "tid": lanes[(d, "compute")], "name": "waits for its unit's gather",
             "cat": STALL, "ts": start / 1e3, "dur": (end - start) / 1e3}
            for d, start, end in result.records.stalls.tolist() if (d, "compute") in lanes]


def _memory_events(result: SimResult) -> list[dict]:
    # Replica 0's devices only: the memory ledger is built from replica 0 (the replicas run the same program).
    events = []
    for d, mem in enumerate(result.memory):
        for t, used in zip(mem.times.tolist(), mem.bytes_in_use.tolist()):
            events.append({"ph": "C", "pid": d, "name": "memory", "ts": t / 1e3, "args": {"GiB": used / 2**30}})
    return events


def chrome_trace(result: SimResult) -> dict:
    """The trace as a JSON-ready dict (timestamps in microseconds)."""
    names = _lane_names(result)
    lanes = _lanes(result, names)
    events = (_metadata(result, lanes) + _op_events(result, names, lanes) + _stall_events(result, lanes)
              + _memory_events(result) + _link_events(result))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"schedule": result.schedule.name}}


def write_trace(result: SimResult, path: str) -> None:
    """Write the trace atomically; gzip-compressed when the name ends in ``.gz``."""
    data = json.dumps(chrome_trace(result), separators=(",", ":")).encode()
    write_atomic(path, gzip.compress(data, compresslevel=6) if path.lower().endswith(".gz") else data)
