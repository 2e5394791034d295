"""The memory ledger: per device, static state (weights x versions, gradients, optimizer) plus a
timeline of what ops stash and free (activations, deferred-W inputs, recompute inputs, p2p buffers).

Byte counts per parameter (ZeRO paper's accounting, Adam):
  bf16/fp16 mixed precision: weights 2 (each extra stashed version 2 more), gradients 2,
  optimizer 12 (fp32 master copy 4 + momentum 4 + variance 4) -> 16 bytes per parameter.
  fp32: weights 4 (+4 per extra version), gradients 4, optimizer 8 (momentum + variance) -> 16.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from simulator.costs import StageCost
from simulator.ir import Action

WEIGHT_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
GRAD_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
OPTIMIZER_BYTES = {"bf16": 12, "fp16": 12, "fp32": 8}


@dataclass(frozen=True)
class StaticMemory:
    """Bytes a device holds for the whole run."""

    weights: int
    gradients: int
    optimizer: int

    @property
    def total(self) -> int:
        return self.weights + self.gradients + self.optimizer


def static_memory(params: int, versions: int, precision: str) -> StaticMemory:
    """Weights times the versions held, one gradient buffer, Adam state."""
    return StaticMemory(params * WEIGHT_BYTES[precision] * versions, params * GRAD_BYTES[precision],
                        params * OPTIMIZER_BYTES[precision])


@dataclass
class MemoryEvents:
    """Flat (device, time, delta) rows; ``units`` counts stashed activations in device-stages."""

    device: list[int]
    time: list[int]
    delta: list[int]
    units: list[float]

    def add(self, device: int, time: int, delta: int, units: float = 0.0) -> None:
        self.device.append(device)
        self.time.append(time)
        self.delta.append(delta)
        self.units.append(units)


def op_memory_events(events: MemoryEvents, device: int, action: Action, start: int, end: int, cost: StageCost,
                     recompute: bool, chunks: int) -> None:
    """What one compute op stashes and frees (SCHEDULES.md section 0 bookkeeping).

    F stashes M_B (only the stage input under recompute); I turns it into M_W; W frees M_W;
    a fused B frees everything. Under recompute a backward first rebuilds M_B.
    """
    unit = 1.0 / chunks
    kept = cost.input_bytes if recompute else cost.activation_bytes
    if action.kind == "F":
        events.add(device, start, kept, unit)
        return
    if action.kind == "W":
        events.add(device, end, -cost.weight_grad_bytes)
        return
    if recompute:
        events.add(device, start, cost.activation_bytes)
        kept += cost.activation_bytes
    residue = cost.weight_grad_bytes if action.kind == "I" else 0
    events.add(device, end, residue - kept, -unit)


@dataclass(frozen=True)
class DeviceMemory:
    """One device's timeline (time ns, bytes in use) and its peaks."""

    times: np.ndarray
    bytes_in_use: np.ndarray
    peak_bytes: int
    peak_activations: float


def device_timelines(events: MemoryEvents, static: list[int]) -> list[DeviceMemory]:
    """Cumulative bytes per device; at equal times frees come before allocations."""
    dev = np.asarray(events.device, dtype=np.int64)
    time = np.asarray(events.time, dtype=np.int64)
    delta = np.asarray(events.delta, dtype=np.int64)
    units = np.asarray(events.units, dtype=np.float64)
    order = np.lexsort((units, delta, time, dev))
    dev, time, delta, units = dev[order], time[order], delta[order], units[order]
    out = []
    for d, base in enumerate(static):
        mask = dev == d
        used = base + np.cumsum(delta[mask])
        stash = np.cumsum(units[mask])
        peak = int(used.max()) if used.size else base
        peak_units = float(np.round(stash.max(), 9)) if stash.size else 0.0
        out.append(DeviceMemory(time[mask], used, max(peak, base), max(peak_units, 0.0)))
    return out
