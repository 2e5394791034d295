"""A test oracle: sail-sg's greedy V scheduler (``zbv_greedy.py`` in sail-sg/zero-bubble-pipeline-parallelism,
commit 39f2c186), written afresh in the reference's own data layout, for clarity, not speed.

Layout: ``table[d][t]`` is the list of unit slots of lane ``t`` on device ``d``, indexed by microbatch. Lanes: 0 F
of chunk 0, 1 F of chunk 1, 2 I of chunk 1, 3 I of chunk 0, then the W lanes (one anonymous lane, the k-th W after
the k-th I; or, split, the chunk-1 W's then the chunk-0 W's). The algorithm:
  1. the stable pattern shifted by 6 slots per microbatch;
  2. re-pack 1: W's put in the first free slots, then warm-up and cool-down ops moved into the earliest free slot
     their dependencies allow, where the device's memory (F +1, W -1) stays under the pattern's peak; squeeze at
     unit time;
  3. re-pack 2: W's dropped, cool-down ops moved again, memory now counting each pending W as done in the next
     free slot; W's put back, squeeze at unit time;
  4. W's dropped and put back split by chunk (chunk 1 first), then timed with the real F, I, W.
Independent of simulator/schedules/vshape.py by construction: it shares no code with it.
"""

from __future__ import annotations

LANE_CHUNK = (0, 1, 1, 0)  # the chunk of each F/I lane
LANE_IS_FORWARD = (True, True, False, False)


def stable_pattern(p: int, kind: str) -> list[list[int]]:
    if kind == "half":
        gap = 3 if p % 2 == 0 else 0
        return [[2 * i, 3 * p - i - 2, 3 * p + gap + 2 * i - 1, 6 * p + gap - i - 2] for i in range(p)]
    gap = 2 if p % 3 == 0 else 0
    return [[i, 2 * p - i - 1, 2 * p + gap + i, 4 * p + gap - i - 1] for i in range(p)]


def put_weight_grads(lanes: list[list[int]], split: bool) -> list[list[int]]:
    """The F/I lanes plus W lanes: each free slot takes a pending W (chunk 1's first when split)."""
    taken = {s: t for t, lane in enumerate(lanes) for s in lane}
    w_lanes: list[list[int]] = [[], []] if split else [[]]
    pending = [0, 0]
    last = max(taken)
    for s in range(last + 1):
        if s in taken:
            if taken[s] >= 2:
                pending[taken[s] - 2 if split else 0] += 1
        else:
            for w in range(2):
                if pending[w]:
                    w_lanes[w].append(s)
                    pending[w] -= 1
                    break
    s = last
    for w in range(2):
        for _ in range(pending[w]):
            s += 1
            w_lanes[w].append(s)
    return [list(lane) for lane in lanes] + w_lanes


def memory_peak(lanes: list[list[int]]) -> int:
    """Peak of F +1, W -1 over the slots; without W lanes each pending W is done in the next free slot."""
    events = {s: t for t, lane in enumerate(lanes) for s in lane}
    explicit = len(lanes) > 4
    level = peak = pending = 0
    for s in range(max(events) + 1):
        t = events.get(s)
        if t is not None:
            level += 1 if t < 2 else (-1 if t >= 4 else 0)
            pending += 1 if t in (2, 3) else 0
        elif not explicit and pending:
            level, pending = level - 1, pending - 1
        peak = max(peak, level)
    return peak


def global_order(table: list[list[list[int]]]) -> list[tuple[int, int, int, int]]:
    """Every op as (slot, device, lane, microbatch), in the order sail-sg visits them."""
    return sorted((s, d, t, mb) for d, lanes in enumerate(table) for t, lane in enumerate(lanes)
                  for mb, s in enumerate(lane))


def same_lane_neighbour(d: int, t: int, p: int) -> int | None:
    """The device whose same-lane op of the same microbatch must come first (chunk-0 F and chunk-1 I run up the
    devices, the other two down)."""
    up = t in (0, 2)
    other = d - 1 if up else d + 1
    return other if 0 <= other < p and t < 4 else None


def eager(table: list[list[list[int]]], cost: list[float], comm: float = 0.0,
          ) -> tuple[list[list[list[float]]], list[list[tuple]]]:
    """Start times when every op runs as soon as its inputs (``comm`` later from another device) and its device
    allow, devices keeping slot order."""
    p = len(table)
    end: dict[tuple[int, int, int], float] = {}
    order: list[list[tuple]] = [[] for _ in range(p)]
    start = [[[0.0] * len(lane) for lane in lanes] for lanes in table]
    for _, d, t, mb in global_order(table):
        ready = 0.0
        other = same_lane_neighbour(d, t, p)
        if other is not None:
            ready = end[(other, t, mb)] + comm
        if 0 < t < 4:
            ready = max(ready, end[(d, t - 1, mb)])
        if mb > 0:
            ready = max(ready, end[(d, t, mb - 1)])
        if order[d]:
            ready = max(ready, end[(d, *order[d][-1])])
        start[d][t][mb] = ready
        end[(d, t, mb)] = ready + cost[t]
        order[d].append((t, mb))
    return start, order


def earliest_allowed(table: list[list[list[int]]], d: int, t: int, mb: int) -> int:
    """One past the latest slot of anything this op needs (its inputs, its lane's previous microbatch)."""
    p, lanes = len(table), table[d]
    need = -1
    other = same_lane_neighbour(d, t, p)
    if other is not None:
        need = table[other][t][mb]
    if 0 < t < 4:
        need = max(need, lanes[t - 1][mb])
    if t == 4:
        need = max(need, sorted(lanes[2] + lanes[3])[mb])
    if mb > 0:
        need = max(need, lanes[t][mb - 1])
    return need + 1


def repack(table: list[list[list[int]]], with_w: bool) -> list[list[list[int]]]:
    """Move ops into earlier free slots under the memory cap (the warm-up too when ``with_w``), then squeeze."""
    table = [put_weight_grads(lanes, split=False) if with_w else [list(x) for x in lanes] for lanes in table]
    cap = max(memory_peak(lanes) for lanes in table)
    m = len(table[0][0])
    occupied = [{s for lane in lanes for s in lane} for lanes in table]
    phase = 0
    for now, d, t, mb in global_order(table):
        if phase == 0 and (t, d) == (3, 0):
            phase = 1
        if phase == 1:
            phase += 1 if (t, mb) == (0, m - 1) else 0
            continue
        if phase == 0 and not with_w:
            continue
        occupied[d].discard(now)
        table[d][t][mb] = now
        for slot in range(earliest_allowed(table, d, t, mb), now):
            if slot not in occupied[d]:
                table[d][t][mb] = slot
                if memory_peak(table[d]) <= cap:
                    break
                table[d][t][mb] = now
        occupied[d].add(table[d][t][mb])
    if not with_w:
        table = [put_weight_grads(lanes, split=False) for lanes in table]
    start, _ = eager(table, [1] * 5)
    return [[[int(x) for x in lane] for lane in lanes[:4]] for lanes in start]


def reference_schedule(p: int, m: int, f: float, i: float, w: float, kind: str = "half", comm: float = 0.0):
    """((start times, per-device op orders), slot table) of sail-sg's schedule for per-chunk F, I, W."""
    table = [[list(range(x, x + 6 * m, 6)) for x in block] for block in stable_pattern(p, kind)]
    table = repack(repack(table, with_w=True), with_w=False)
    table = [put_weight_grads(lanes, split=True) for lanes in table]
    return eager(table, [f, f, i, i, w, w], comm), table


def peak(events: list[tuple[float, float]]) -> float:
    """Most held at once; at equal times frees come first."""
    level = top = 0.0
    for _, delta in sorted(events):
        level += delta
        top = max(top, level)
    return top


def reference_metrics(p: int, m: int, f: float, i: float, w: float, kind: str = "half",
                      comm: float = 0.0) -> dict:
    """Bubble rate (1 - busy / longest device span, every device equally busy) and, per device, peak activations in
    device-stages (a chunk's activation is half a device-stage) held from F's start to I's end and to W's end."""
    (start, _), _ = reference_schedule(p, m, f, i, w, kind, comm)
    cost = [f, f, i, i, w, w]
    spans, until_i, until_w = [], [], []
    for lanes in start:
        spans.append(max(s + cost[t] for t, lane in enumerate(lanes) for s in lane) - min(map(min, lanes)))
        held = [(s, 0.5) for t in (0, 1) for s in lanes[t]]
        until_i.append(peak(held + [(s + cost[t], -0.5) for t in (2, 3) for s in lanes[t]]))
        until_w.append(peak(held + [(s + cost[t], -0.5) for t in (4, 5) for s in lanes[t]]))
    return {"bubble_rate": 1 - 2 * m * (f + i + w) / max(spans), "longest_span": max(spans),
            "until_i": until_i, "until_w": until_w}
