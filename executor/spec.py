"""What the real executor runs (``RunSpec``): its own module so the rank state, the reference and the launcher all
import it without importing each other."""

from __future__ import annotations

import math
from dataclasses import dataclass

from pipescope.executor.weights import OPTIMIZERS
from pipescope.executor.zero import ZERO_STAGES
from pipescope.calibration.presets import Shape
from pipescope.simulator.ir import Action, ActionKind, Schedule, WeightUpdate


@dataclass(frozen=True)
class RunSpec:
    """What to run: the schedule, the model shape, the batch, the optimizer, the replicas, how often, and a fault to
    inject (tests). ``clip_norm`` None turns clipping off; ``iterations`` measured runs of the program follow
    ``warmup`` unmeasured ones, and the weights train through all of them."""

    schedule: Schedule
    shape: Shape
    microbatch_size: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    iterations: int = 1
    warmup: int = 0
    seed: int = 0
    optimizer: str = "adamw"
    lr: float = 1e-3
    clip_norm: float | None = 1.0
    data_parallel: int = 1
    zero: int = 0  # ZeRO over the replicas: 0 to 3 (``executor.zero``)
    reshard_after_forward: bool = True  # ZeRO-3: gather per op (FSDP's default), else at torch's FSDP actions
    device: str = "cpu"
    timeout_s: float = 120.0
    inject: tuple[str, int, int] | None = None  # ("exit" | "hang", rank, step): a rank that dies or hangs there
    numerics: bool = True  # keep the last run's gradients and the final weights (False for timing runs)
    cpu_time: bool = False  # time actions by the rank's thread CPU time, not the wall clock (CPU ranks only)

    @property
    def world(self) -> int:
        return self.schedule.num_devices * self.data_parallel

    def check(self) -> None:
        """ValueError, one line naming the field, for a value the executor cannot run."""
        bad = [("optimizer", self.optimizer, f"one of {', '.join(OPTIMIZERS)}", self.optimizer not in OPTIMIZERS),
               ("lr", self.lr, "a positive finite number", not (math.isfinite(self.lr) and self.lr > 0)),
               ("clip_norm", self.clip_norm, "None or a positive finite number", self.clip_norm is not None
                and not (math.isfinite(self.clip_norm) and self.clip_norm > 0)),
               ("data_parallel", self.data_parallel, "an integer >= 1",
                not isinstance(self.data_parallel, int) or self.data_parallel < 1),
               ("iterations", self.iterations, "an integer >= 1", self.iterations < 1),
               ("warmup", self.warmup, "an integer >= 0", self.warmup < 0),
               ("device", self.device, "cpu or cuda", self.device not in ("cpu", "cuda")),
               ("schedule", self.schedule.name, "a schedule of one pipeline (the executor's stages hand on to the "
                "next one; a bidirectional schedule's two copies of the model are not built)",
                self.schedule.pipelines > 1), *self._zero_checks()]
        for name, value, expected, wrong in bad:
            if wrong:
                raise ValueError(f"RunSpec.{name}: got {value!r}, expected {expected}")

    def _zero_checks(self) -> list[tuple[str, object, str, bool]]:
        """ZeRO's: a stage of 0-3, sharded over replicas, one step an iteration, and ZeRO-2's and 3's gradients
        made whole by whole backward ops (an I/W split would keep them whole from I to W)."""
        if self.zero not in ZERO_STAGES:
            return [("zero", self.zero, "0, 1, 2 or 3", True)]
        if not self.zero:
            return []
        split = any(a is not None and a.kind is ActionKind.I for acts in self.schedule.device_actions for a in acts)
        return [("zero", self.zero, "data_parallel >= 2 (the replicas it shards over)", self.data_parallel < 2),
                ("zero", self.zero, f"a flush schedule (one step an iteration), not {self.schedule.name}",
                 self.schedule.weight_update is not WeightUpdate.FLUSH),
                ("zero", self.zero, f"0 or 1 with {self.schedule.name}, whose backward is split into I and W",
                 self.zero >= 2 and split)]


# A p2p action -> (which way its peer stage is, the SEND of the message it moves, as the stage offset and kind)
_MESSAGES = {ActionKind.SEND_F: (1, 0, ActionKind.SEND_F), ActionKind.SEND_B: (-1, 0, ActionKind.SEND_B),
             ActionKind.RECV_F: (-1, -1, ActionKind.SEND_F), ActionKind.RECV_B: (1, 1, ActionKind.SEND_B)}


def p2p_order_mismatch(program: Schedule) -> str | None:
    """Where two devices of a lowered program post the transfers between them in different orders, in one line;
    None when every pair agrees. nccl matches a pair's sends and receives in the order they are posted (it has no
    tags, as gloo does), so such a program would hang or hand a tensor to the wrong receive on GPUs."""
    home = program.stage_to_device
    posted: dict[tuple[int, int], list[Action]] = {}  # (device, peer) -> the messages it posts to or from the peer
    for device, actions in enumerate(program.device_actions):
        for a in actions:
            if a is not None and a.kind in _MESSAGES:
                way, offset, send = _MESSAGES[a.kind]
                posted.setdefault((device, home[a.stage + way]), []).append(Action(a.stage + offset, send,
                                                                                   a.microbatch))
    for device, peer in sorted({tuple(sorted(pair)) for pair in posted}):
        mine, theirs = posted.get((device, peer), []), posted.get((peer, device), [])
        if mine != theirs:
            k = next(i for i in range(len(mine) + 1) if i == len(mine) or i == len(theirs) or mine[i] != theirs[i])
            here, there = (str(x[k]) if k < len(x) else "nothing" for x in (mine, theirs))
            return (f"devices {device} and {peer} post their transfers in different orders: transfer {k + 1} is "
                    f"{here} on device {device}, {there} on device {peer}")
    return None
