"""Schedule generators: pure functions ``(p, m, ...) -> Schedule``, found by name."""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable

from pipescope.simulator.ir import Schedule
from pipescope.simulator.schedules.basic import gpipe, one_f_one_b
from pipescope.simulator.schedules.interleaved import interleaved
from pipescope.simulator.schedules.pipedream import pipedream, two_bw
from pipescope.simulator.schedules.vshape import v_half, v_min
from pipescope.simulator.schedules.zero_bubble import zb_h1, zb_h2, zb_v


@dataclass(frozen=True)
class Generator:
    """A named generator and what ``pipescope schedules`` says of it."""

    name: str
    build: Callable[..., Schedule]
    description: str
    min_chunks: int = 1


GENERATORS: dict[str, Generator] = {}
ALIASES = {"flush": "1f1b", "pipedream-flush": "1f1b"}


def register(gen: Generator) -> None:
    GENERATORS[gen.name] = gen


register(Generator("gpipe", gpipe, "GPipe: all forwards, then all backwards, one flush per iteration"))
register(Generator("1f1b", one_f_one_b,
                   "PipeDream-Flush (= Megatron/torch 1F1B, alias 'flush'): warm-up forwards, 1F1B pairs, flush"))
register(Generator("pipedream", pipedream,
                   "PipeDream: asynchronous 1F1B with weight stashing, no flush (p-r weight versions on device r); "
                   "options iterations=3, vertical_sync=False (then p versions on every device)"))
register(Generator("2bw", two_bw,
                   "PipeDream-2BW: 1F1B without a flush, m >= p gradients coalesced per update, 2 weight versions; "
                   "option iterations=3"))
register(Generator("interleaved", interleaved,
                   "Interleaved 1F1B (Megatron/torch): chunks >= 2 looped stages per device, m >= p "
                   "(cut into m // p rounds; Megatron's order when p divides m)", min_chunks=2))
register(Generator("zb-h1", zb_h1, "ZB-H1: 1F1B memory, split I/W, device r defers r W's; bubble (p-1)(F+I-W)"))
register(Generator("zb-h2", zb_h2, "ZB-H2: 2(p-r)-1 warm-up forwards, device r defers 2r W's; bubble (p-1)(F+I-2W)"))
register(Generator("zb-v", zb_v, "ZB-V (torch ScheduleZBVZeroBubble): V placement, 2 chunks (chunks=1 read as 2), "
                   "p activations per device, no bubble when F = I = W and m >= 2p-1", min_chunks=2))
register(Generator("v-half", v_half, "V-Half: V placement, 2 chunks (chunks=1 read as 2), "
                   "(p+2)//2 activations per device", min_chunks=2))
register(Generator("v-min", v_min, "V-Min: V placement, 2 chunks (chunks=1 read as 2), "
                   "(p+4)//3 activations per device", min_chunks=2))


def generator(name: str) -> Generator:
    """The generator called ``name`` (aliases allowed); KeyError if none."""
    return GENERATORS[ALIASES.get(name, name)]


def build(name: str, stages: int, microbatches: int, chunks: int = 1, recompute: bool = False,
          **options: object) -> Schedule:
    """Build the named schedule for ``stages`` devices and ``microbatches`` per iteration."""
    return generator(name).build(stages, microbatches, chunks=chunks, recompute=recompute, **options)
