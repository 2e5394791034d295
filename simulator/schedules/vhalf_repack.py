"""sail-sg's greedy re-pack of a V schedule's unit slots (``zbv_greedy.py``), behind ``v-half`` and ``v-min``.

A device's ops sit in integer slots, one op per slot, grouped in lanes: the F and I of each chunk in building-block
order (F0, F1, I1, I0), then the W's. The re-pack (docs/schedules.md section 6):
  1. W's go into the first free slots after their I's; warm-up and cool-down ops move into the earliest free slot
     their inputs allow, as long as the device's activations (F +1, W -1) stay under the block's peak; squeeze.
  2. W's are dropped and the cool-down is re-packed once more, now counting each pending W as done in the next free
     slot, so F's and I's may take slots the W's held; W's go back in; squeeze.
Step 2 is what brings V-Half's bubble from about 0.6 to about 1/2 of 1F1B's: in step 1 each W sits in the first
hole after its I, so the cool-down's I's, which the devices before them wait for, cannot pass it; without the W's
they can, and the W's then fill the drain's idle time. "Squeeze" is unit-time: each op starts as soon as its
inputs and its device allow, which closes the gaps the moves left. The slots, hence the order, do not depend on
the F, I, W costs.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from dataclasses import dataclass

from pipescope.simulator.ir import Action, ActionKind, producers

# Lanes of a device's slot table. The one W lane holds the k-th W after the k-th I (which I does not matter for the
# re-pack); split, lane W1 holds chunk 1's W's and W0 chunk 0's, each in microbatch order.
F0, F1, I1, I0, W1, W0 = range(6)
LANE_KINDS = ((ActionKind.F, 0), (ActionKind.F, 1), (ActionKind.I, 1), (ActionKind.I, 0),
              (ActionKind.W, 1), (ActionKind.W, 0))
ACTIVATIONS = (1, 1, 0, 0, -1, -1)  # what each lane adds to the activations held (sail-sg's mem_of_stage)
INPUT_GRADS = (I1, I0)

Position = tuple[int, int]  # (slot, device): sail-sg visits ops in this order
Needs = list[list[list[tuple[int, int]]]]  # [device][lane] -> (device, lane) of the same microbatch it needs


@dataclass
class Device:
    """One device's slot table: ``lanes[lane][index]`` is a slot, ``occupant[slot]`` the (lane, index) there."""

    lanes: list[list[int]]
    occupant: dict[int, tuple[int, int]]

    @classmethod
    def of(cls, lanes: list[list[int]]) -> Device:
        occupant = {slot: (lane, index) for lane, slots in enumerate(lanes) for index, slot in enumerate(slots)}
        return cls([list(slots) for slots in lanes], occupant)

    def move(self, lane: int, index: int, slot: int) -> None:
        del self.occupant[self.lanes[lane][index]]
        self.lanes[lane][index] = slot
        self.occupant[slot] = (lane, index)

    @property
    def last(self) -> int:
        return max(self.occupant)


def stage_of(device: int, p: int, chunk: int) -> int:
    """Device d's chunk 0 is stage d, its chunk 1 is stage 2p-1-d (the V)."""
    return device if chunk == 0 else 2 * p - 1 - device


def lane_needs(p: int) -> Needs:
    """Which F/I lanes each F/I lane waits for, from ``simulator.ir.producers`` (the one dependency rule)."""
    home = {(stage_of(d, p, chunk), kind): (d, lane)
            for d in range(p) for lane, (kind, chunk) in enumerate(LANE_KINDS[:W1])}
    present = {Action(stage, kind, 0) for stage, kind in home}
    return [[[home[(a.stage, a.kind)] for a in producers(Action(stage_of(d, p, chunk), kind, 0), 2 * p, present)]
             for kind, chunk in LANE_KINDS[:W1]] for d in range(p)]


def put_weight_grads(device: Device, split: bool) -> Device:
    """The F/I lanes plus W's in the first free slots after their I's (sail-sg's put_w): one W lane, or, split,
    chunk 1's W's before chunk 0's when both wait."""
    lanes = device.lanes[:W1]
    taken = {slot: here for slot, here in device.occupant.items() if here[0] < W1}
    w_lanes: list[list[int]] = [[], []] if split else [[]]
    waiting = [0, 0]
    last = max(taken)
    for slot in range(last + 1):
        here = taken.get(slot)
        if here is not None:
            if here[0] in INPUT_GRADS:
                waiting[INPUT_GRADS.index(here[0]) if split else 0] += 1
        elif waiting[0] or waiting[1]:
            w = 0 if waiting[0] else 1
            w_lanes[w].append(slot)
            waiting[w] -= 1
    tail = [w for w in (0, 1) for _ in range(waiting[w])]
    for offset, w in enumerate(tail, start=1):
        w_lanes[w].append(last + offset)
    return Device.of(lanes + w_lanes)


def squeeze(devices: list[Device], needs: Needs) -> list[Device]:
    """Unit-time ASAP: each op starts once its inputs end and its device's previous op ends, in slot order."""
    new = [[[0] * len(slots) for slots in device.lanes] for device in devices]
    free = [0] * len(devices)
    for slot in range(max(device.last for device in devices) + 1):
        for d, device in enumerate(devices):
            here = device.occupant.get(slot)
            if here is None:
                continue
            lane, index = here
            start = free[d]
            for other, other_lane in needs[d][lane] if lane < W1 else ():
                ready = new[other][other_lane][index] + 1
                start = ready if ready > start else start
            new[d][lane][index] = start
            free[d] = start + 1
    return [Device.of(lanes) for lanes in new]


def explicit_levels(device: Device) -> list[int]:
    """Activations held after each slot, W's in their slots."""
    level, levels = 0, []
    for slot in range(device.last + 1):
        here = device.occupant.get(slot)
        level += ACTIVATIONS[here[0]] if here else 0
        levels.append(level)
    return levels


def drain_step(level: int, waiting: int, lane: int | None) -> tuple[int, int]:
    """One slot with W's implicit: an op adds its activations (an I one waiting W); a free slot runs a W."""
    if lane is not None:
        return level + ACTIVATIONS[lane], waiting + (lane in INPUT_GRADS)
    return (level - 1, waiting - 1) if waiting else (level, waiting)


@dataclass
class ImplicitMemory:
    """Activations and waiting W's after each slot of a W-less device (sail-sg's mem_of_stage without W's)."""

    levels: list[int]
    waiting: list[int]

    @classmethod
    def of(cls, device: Device) -> ImplicitMemory:
        memory = cls([], [])
        level = waiting = 0
        for slot in range(device.last + 1):
            here = device.occupant.get(slot)
            level, waiting = drain_step(level, waiting, here[0] if here else None)
            memory.levels.append(level)
            memory.waiting.append(waiting)
        return memory

    def replay(self, device: Device, lane: int, to: int, now: int, cap: int) -> list[tuple[int, int]] | None:
        """The states from slot ``to`` on if the op at ``now`` moved there, until they rejoin today's (later slots
        are unchanged); None if the activations would pass ``cap``."""
        level, waiting = (self.levels[to - 1], self.waiting[to - 1]) if to else (0, 0)
        states = []
        for slot in range(to, len(self.levels)):
            here = lane if slot == to else (None if slot == now else device.occupant.get(slot, (None,))[0])
            level, waiting = drain_step(level, waiting, here)
            if level > cap:
                return None
            if slot >= now and (level, waiting) == (self.levels[slot], self.waiting[slot]):
                break
            states.append((level, waiting))
        return states

    def commit(self, to: int, states: list[tuple[int, int]]) -> None:
        for slot, (level, waiting) in enumerate(states, start=to):
            self.levels[slot], self.waiting[slot] = level, waiting


def steady_span(devices: list[Device], m: int) -> tuple[Position, Position]:
    """The steady state the re-pack keeps: from device 0's first chunk-0 I to the next last-microbatch chunk-0 F."""
    first = (devices[0].lanes[I0][0], 0)
    later = [(device.lanes[F0][m - 1], d) for d, device in enumerate(devices) if (device.lanes[F0][m - 1], d) > first]
    never = (max(device.last for device in devices) + 1, 0)  # m small: device 0's went by before its first I0
    return first, min(later, default=never)


def earliest_input_ready(devices: list[Device], needs: Needs, d: int, lane: int, index: int,
                         input_grads: list[int]) -> int:
    """One past the latest slot of what the op needs: its inputs and its lane's previous op. A W (one lane) needs
    the index-th I in slot order (``input_grads``, sorted)."""
    device = devices[d]
    need = device.lanes[lane][index - 1] if index else -1
    if lane >= W1:
        return max(need, input_grads[index]) + 1
    for other, other_lane in needs[d][lane]:
        need = max(need, devices[other].lanes[other_lane][index])
    return need + 1


def earliest_under_cap(device: Device, levels: list[int], lane: int, low: int, now: int, cap: int) -> int:
    """The earliest free slot in [low, now) the op can take with W's explicit, activations staying <= cap."""
    limit, best = cap - ACTIVATIONS[lane], now
    for slot in range(now - 1, low - 1, -1):
        if levels[slot] > limit:
            break  # the op would be held over this slot too, and earlier slots only add more
        if slot not in device.occupant:
            best = slot
    return best


def repack_with_weight_grads(devices: list[Device], needs: Needs, m: int) -> list[Device]:
    """Step 1: W's placed, warm-up and cool-down ops moved earlier under the explicit-W cap, squeezed."""
    devices = [put_weight_grads(device, split=False) for device in devices]
    levels = [explicit_levels(device) for device in devices]
    cap = max(max(level) for level in levels)
    input_grads = [sorted(device.lanes[I1] + device.lanes[I0]) for device in devices]
    first, last = steady_span(devices, m)
    for now in range(max(device.last for device in devices) + 1):
        for d, device in enumerate(devices):
            here = device.occupant.get(now)
            if here is None or first <= (now, d) <= last:
                continue
            lane, index = here
            low = earliest_input_ready(devices, needs, d, lane, index, input_grads[d])
            slot = earliest_under_cap(device, levels[d], lane, low, now, cap)
            if slot < now:
                device.move(lane, index, slot)
                levels[d][slot:now] = [level + ACTIVATIONS[lane] for level in levels[d][slot:now]]
                if lane in INPUT_GRADS:
                    del input_grads[d][bisect_left(input_grads[d], now)]
                    insort(input_grads[d], slot)
    return squeeze(devices, needs)


def repack_cool_down(devices: list[Device], needs: Needs, m: int) -> list[Device]:
    """Step 2: W's dropped, cool-down ops moved earlier under the implicit-W cap, W's put back, squeezed."""
    devices = [Device.of(device.lanes[:W1]) for device in devices]
    memory = [ImplicitMemory.of(device) for device in devices]
    cap = max(max(mem.levels) for mem in memory)
    _, last = steady_span(devices, m)
    for now in range(last[0], max(device.last for device in devices) + 1):
        for d, device in enumerate(devices):
            here = device.occupant.get(now)
            if here is None or (now, d) <= last:
                continue
            lane, index = here
            for slot in range(earliest_input_ready(devices, needs, d, lane, index, []), now):
                states = None if slot in device.occupant else memory[d].replay(device, lane, slot, now, cap)
                if states is not None:
                    device.move(lane, index, slot)
                    memory[d].commit(slot, states)
                    break
    return squeeze([put_weight_grads(device, split=False) for device in devices], needs)


def greedy_repack(blocks: list[list[list[int]]], p: int, m: int) -> list[Device]:
    """sail-sg's schedule_from_pattern: both re-packs, then W's placed split by chunk (chunk 1 first)."""
    needs = lane_needs(p)
    devices = [Device.of(lanes) for lanes in blocks]
    devices = repack_cool_down(repack_with_weight_grads(devices, needs, m), needs, m)
    return [put_weight_grads(device, split=True) for device in devices]
