"""Our interleaved 1F1B and ZB-V orders are torch.distributed.pipelining's (skipped without torch)."""

from __future__ import annotations

import pytest

from pipescope.simulator.schedules import build

pytest.importorskip("torch")
torch_schedules = pytest.importorskip("pipescope.calibration.torch_schedules")


def compute_orders(schedule) -> list[list[str]]:
    return [[str(a) for a in schedule.compute_actions(d)] for d in range(schedule.num_devices)]


@pytest.mark.parametrize(("p", "m"), [(2, 2), (2, 5), (4, 4), (4, 7), (4, 8), (8, 16)])
def test_zb_v_is_torch_schedule_zbv_zero_bubble(p, m):
    """Same per-device compute order as torch's ScheduleZBVZeroBubble, m < 2p-1 included."""
    ours = build("zb-v", p, m)
    assert compute_orders(ours) == compute_orders(torch_schedules.torch_schedule("ZBVZeroBubble", p, m, 2))


@pytest.mark.parametrize(("p", "m", "v"), [(2, 4, 2), (4, 4, 2), (4, 6, 3), (4, 8, 2), (4, 12, 4), (8, 16, 2)])
def test_interleaved_is_torch_schedule_interleaved_1f1b(p, m, v):
    """Same per-device compute order as torch's ScheduleInterleaved1F1B wherever torch accepts m."""
    ours = build("interleaved", p, m, chunks=v)
    assert compute_orders(ours) == compute_orders(torch_schedules.torch_schedule("Interleaved1F1B", p, m, v))
