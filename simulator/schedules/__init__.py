"""Schedule generators: pure functions ``(p, m, ...) -> Schedule``, found by name."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from pipescope.simulator.readers.csvio import read_csv
from pipescope.simulator.ir import Schedule
from pipescope.simulator.parallel import parse_recompute
from pipescope.simulator.readers.units import did_you_mean, short_repr
from pipescope.simulator.schedules.basic import gpipe, one_f_one_b
from pipescope.simulator.schedules.chimera import chimera
from pipescope.simulator.schedules.dualpipe import dualpipe, dualpipev
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
    default_chunks: int = 1  # stages per device when schedule.chunks is not given
    options: frozenset[str] = frozenset()  # keyword options beyond (p, m, chunks, recompute), e.g. iterations


GENERATORS: dict[str, Generator] = {}
ALIASES = {"flush": "1f1b", "pipedream-flush": "1f1b"}


def register(gen: Generator) -> None:
    GENERATORS[gen.name] = gen


register(Generator("gpipe", gpipe, "GPipe: all forwards, then all backwards, one flush per iteration"))
register(Generator("1f1b", one_f_one_b,
                   "PipeDream-Flush (= Megatron/torch 1F1B, alias 'flush'): warm-up forwards, 1F1B pairs, flush"))
register(Generator("pipedream", pipedream,
                   "PipeDream: asynchronous 1F1B with weight stashing, no flush (p-r weight versions on device r); "
                   "options iterations=3, vertical_sync=False (then p versions on every device)",
                   options=frozenset({"iterations", "vertical_sync"})))
register(Generator("2bw", two_bw,
                   "PipeDream-2BW: 1F1B without a flush, m >= p gradients coalesced per update, 2 weight versions; "
                   "option iterations=3", options=frozenset({"iterations"})))
register(Generator("interleaved", interleaved,
                   "Interleaved 1F1B (Megatron/torch): chunks >= 2 looped stages per device, m >= p "
                   "(cut into m // p rounds; Megatron's order when p divides m)", default_chunks=2))
register(Generator("zb-h1", zb_h1, "ZB-H1: 1F1B memory, split I/W, device r defers r W's; bubble (p-1)(F+I-W)"))
register(Generator("zb-h2", zb_h2, "ZB-H2: 2(p-r)-1 warm-up forwards, device r defers 2r W's; bubble (p-1)(F+I-2W)"))
register(Generator("zb-v", zb_v, "ZB-V (torch ScheduleZBVZeroBubble): V placement, 2 chunks, "
                   "p activations per device, no bubble when F = I = W and m >= 2p-1", default_chunks=2))
register(Generator("v-half", v_half, "V-Half: V placement, 2 chunks, "
                   "(p+2)//2 activations per device", default_chunks=2))
register(Generator("dualpipev", dualpipev, "DualPipeV (DeepSeek-V3's DualPipe cut in half; torch ScheduleDualPipeV): "
                   "V placement, 2 chunks, m >= 2p, forward-and-backward pairs in the steady state",
                   default_chunks=2))
register(Generator("dualpipe", dualpipe, "DualPipe (DeepSeek-V3): two pipelines of p stages over p devices (p even), "
                   "fed from both ends, each device one stage of each (parameters twice), m even and >= 2p, "
                   "forward-and-backward pairs in the steady state"))
register(Generator("chimera", chimera, "Chimera (Li and Hoefler, SC'21): two pipelines of p stages over p devices "
                   "(p even) in opposite directions, each device one stage of each, units of p microbatches "
                   "concatenated (m a multiple of p), bubble (p-2)/(2m+p-2) when F = B"))
register(Generator("v-min", v_min, "V-Min: V placement, 2 chunks, "
                   "(p+4)//3 activations per device", default_chunks=2))


def generator(name: str) -> Generator:
    """The generator called ``name`` (aliases allowed, any case: ``ZB-V`` is ``zb-v``); KeyError if none."""
    folded = name.lower()
    return GENERATORS[ALIASES.get(folded, folded)]


def build(name: str, stages: int, microbatches: int, chunks: int | None = None, recompute: bool = False,
          **options: object) -> Schedule:
    """Build the named schedule for ``stages`` devices and ``microbatches`` per iteration (``chunks`` per device,
    default the generator's own)."""
    gen = generator(name)
    return _built(gen.name, stages, microbatches, chunks or gen.default_chunks, recompute,
                  tuple(sorted(options.items())))


@functools.lru_cache(maxsize=8)
def _built(name: str, stages: int, microbatches: int, chunks: int, recompute: bool,
           options: tuple[tuple[str, object], ...]) -> Schedule:
    """A generator's schedule, remembered: schedules are immutable, and the planner's neighbouring candidates ask
    for the same one (9,306 candidates of its 64-GPU space need 2,664 builds in their order, 1,176 distinct)."""
    return GENERATORS[name].build(stages, microbatches, chunks=chunks, recompute=recompute, **dict(options))


# Inclusive (low, high) of the schedule section's sizes (docs/cli.md, "Limits"): the config's RANGES takes them.
SCHEDULE_RANGES: dict[str, tuple[int, int]] = {"stages": (1, 100_000), "microbatches": (1, 500_000),
                                               "chunks": (1, 1_000)}


@dataclass(frozen=True)
class ScheduleConfig:
    """The ``schedule`` section. ``stages`` and ``microbatches`` stay None unless given, so a CSV schedule can be
    checked against them; generators use ``p`` and ``m`` (defaults 4 and 8)."""

    name: str = "1f1b"
    stages: int | None = None
    microbatches: int | None = None
    chunks: int | None = None  # None: the schedule's own (2 for interleaved and the V schedules, else 1)
    recompute: str = field(default="none", metadata={"unit": "recompute"})  # parallel.RECOMPUTE_MODES
    vocab: str = "naive"
    vertical_sync: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.name, str) and not self.name.startswith(("csv:", "torch:")):
            object.__setattr__(self, "name", self.name.lower())  # names are matched without regard to case
        try:  # True/False still mean full/none
            object.__setattr__(self, "recompute", parse_recompute(self.recompute))
        except ValueError:
            pass  # kept as given: check_config (and build_schedule) name the key, as for every other field

    @property
    def p(self) -> int:
        return self.stages if self.stages is not None else 4

    @property
    def m(self) -> int:
        return self.microbatches if self.microbatches is not None else 8


def named_generator(name: str) -> Generator:
    """The generator ``schedule.name`` names; ValueError naming the key and every choice when there is none."""
    try:
        return generator(name)
    except KeyError:
        names = ", ".join(list(GENERATORS) + list(ALIASES) + ["torch:<Name>", "csv:<path>"])
        hint = did_you_mean(name, list(GENERATORS) + list(ALIASES))
        raise ValueError(f"schedule.name: got {short_repr(name)}, expected one of {names}{hint}") from None


def check_iterations(name: str, iterations: int | None) -> None:
    """ValueError naming the key when more than one iteration is asked of a schedule that runs one: a schedule with
    a flush, or a csv: or torch: schedule (the iteration it holds). An unknown name is left to its own check."""
    if iterations is None or iterations == 1:
        return
    if name.startswith(("csv:", "torch:")):
        raise ValueError(f"iterations: got {iterations}, expected none: {name.split(':')[0]}: schedules run the one "
                         f"iteration they hold")
    try:
        gen = generator(name)
    except KeyError:  # the name's own check says what is wrong with it
        return
    if "iterations" not in gen.options:
        raise ValueError(f"iterations: got {iterations}, expected none: {gen.name} has a flush and simulates one "
                         f"iteration (iterations applies to schedules without a flush)")


def build_schedule(config: ScheduleConfig, iterations: int | None = None) -> Schedule:
    """The schedule a generator name or ``csv:<path>`` names (``torch:<Name>`` is ``pipescope.run``'s, it needs
    torch). ValueError naming the key on a bad name, option or size; OSError if a CSV cannot be read."""
    try:  # a Python-built config keeps a bad value (ScheduleConfig.__post_init__)
        parse_recompute(config.recompute)
    except ValueError as err:
        raise ValueError(f"schedule.recompute: {err}") from None
    if config.name.startswith("csv:"):
        return _csv_schedule(config)
    gen = named_generator(config.name)
    options: dict[str, object] = {}
    if config.vertical_sync:
        if "vertical_sync" not in gen.options:
            raise ValueError(f"schedule.vertical_sync: got true, but only pipedream has it, not {gen.name}")
        options["vertical_sync"] = True
    check_iterations(config.name, iterations)
    if iterations is not None and "iterations" in gen.options:  # 1 included: not the generator's default
        options["iterations"] = iterations
    return build(gen.name, config.p, config.m, chunks=config.chunks, recompute=config.recompute == "full",
                 **options)


def _csv_schedule(config: ScheduleConfig) -> Schedule:
    """A CSV schedule: its size comes from the file; stages or chunks given as well must agree with it, microbatches
    given are the count the checker holds the file to, and recompute applies to it."""
    path = config.name[4:]
    try:
        schedule = read_csv(path, config.microbatches)
    except OSError as err:
        raise ValueError(f"schedule.name: csv file {path!r} cannot be read ({err.strerror})") from None
    except ValueError as err:
        raise ValueError(f"schedule.name: csv file {path!r}: {err}") from None
    if config.stages is not None and config.stages != schedule.num_devices:
        raise ValueError(f"schedule.stages: got {config.stages}, expected {schedule.num_devices}: the devices "
                         f"{path!r} holds (or leave it unset)")
    if config.chunks is not None and config.chunks != schedule.chunks:
        raise ValueError(f"schedule.chunks: got {config.chunks}, expected {schedule.chunks}: the stages per device "
                         f"{path!r} holds (or leave it unset)")
    return replace(schedule, recompute=config.recompute == "full")
