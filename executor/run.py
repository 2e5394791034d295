"""The real executor: the lowered program the simulator replays, run for real over torch.distributed processes.

Each rank runs its device's list of the program ``simulator.lowering.lower`` makes, action by action
(``executor.state.Rank``: F, I, W, B, SEND/RECV on the GPT pieces of ``calibration.model``), and the optimizer:
torch's AdamW (or SGD, ``RunSpec.optimizer``), one timed row ``{stage}OPT{k}`` (kind OPT) per stage and step, k the
last microbatch whose gradient it applies (the simulator's names). Flush schedules step after the program, the
gradient norm clipped over the whole pipeline; PipeDream's weight stashing and 2BW's two buffers with the delayed
update step inside it (``executor.weights``). With ``data_parallel`` w > 1 there are w replicas of the pipeline
(replica r's device d is rank r*D + d, the simulator's numbering), each on its own microbatches, and each stage's
gradients are averaged over its replicas after its last backward (rows ``{stage}ALL_REDUCE{k}``); the clipping norm's
all-reduce over the pipeline is ``-1ALL_REDUCE{k}``. A receive's row spans its post to its wait's return (the latest
the data can have arrived). Each rank's memory
is tracked exactly in the first run of the program (``executor.memory``; the CUDA allocator's peak on GPUs).

Module map: ``executor.run`` (this: RunSpec, RunResult, the worker and the launcher), ``executor.state`` (one rank's
actions), ``executor.weights`` (versions, gradient buffer, optimizer, update rule), ``executor.memory`` (the
tracker), ``executor.clock`` (the action stamps), ``executor.reference`` (the one-process reference).

Every module is built from its own seed, so the ranks and the one-process reference start from the same weights,
and the numerics tests compare losses, gradients and weights. Start and end of every action are stamped after a
barrier by ``executor.clock``: ``perf_counter_ns`` on CPU (one clock on one machine), CUDA events on a GPU (the GPU's
time, as calibrate's). On CUDA the ranks use nccl, which ignores tags: a program whose two devices post the transfers
between them in different orders is refused before launch (``executor.spec.p2p_order_mismatch``; every built-in
schedule's lowering agrees). A rank that dies or stops
making progress ends the run with one line naming it and its action, and no process is left.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from pipescope.executor.memory import RankMemory, cuda_peak, cuda_reset
from pipescope.executor.reference import Reference, reference_step
from pipescope.executor.spec import RunSpec, p2p_order_mismatch
from pipescope.executor.state import Rank, Row
from pipescope.simulator.ir import ActionKind
from pipescope.simulator.lowering import add_fsdp_actions, lower, step_points

__all__ = ["Reference", "RunError", "RunResult", "RunSpec", "execute", "execute_all", "execute_timed", "free_port",
           "launch", "reference_step"]

RECEIVES = (ActionKind.RECV_F, ActionKind.RECV_B)  # timed by their wait, not their post


@dataclass
class RunResult:
    """``rows``: per measured run of the program, every rank's rows (action, kind, stage, microbatch, start_ns,
    end_ns). ``losses``: the mean loss of every optimizer iteration of every run (warm-up included), ``loss`` the
    last. ``grads``: each parameter's gradient before its last step (averaged over replicas, before clipping).
    ``weights``: per replica, each parameter's final value. ``memory``: per rank, what ``executor.memory`` measured
    in the first run. ``versions``: per rank, in the last run, (F or B, stage, microbatch, weight version used, newest
    version then, the used buffer's in-place write count) for every forward and backward. ``cpu_ns``: per measured
    run, every rank's process CPU time (its ops, gloo's threads, waits that spin)."""

    rows: list[list[list[Row]]]
    losses: list[float]
    grads: dict[str, torch.Tensor]
    weights: list[dict[str, torch.Tensor]]
    memory: list[RankMemory]
    versions: list[list[tuple[str, int, int, int, int, int]]]
    world: int
    cpu_ns: list[list[int]]  # per measured run, every rank's process CPU time over it (all its threads)

    @property
    def loss(self) -> float:
        return self.losses[-1]


STARTUP_S = 120.0  # the longest a rank may take from spawn to its first action


class RunError(RuntimeError):
    """A rank died or hung; the message is one line naming the rank and its action."""


def _worker(rank: int, world: int, port: int, backend: str, body: Callable, payload: object, out: str,
            progress) -> None:
    """One rank: ``body(rank, payload, out, progress)`` in the process group. An exception is written, one line, for
    the supervisor to report."""
    try:
        torch.set_num_threads(1)  # two threads per rank on two cores run 2-6x slower
        torch.set_num_interop_threads(1)
        if backend == "nccl":  # the GPU _run_spec gives this rank, before nccl picks one for its communicators
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        body(rank, payload, out, progress)
        dist.barrier()
        dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    except BaseException as err:  # noqa: BLE001 (the rank ends here either way; the reason must reach the parent)
        Path(out, f"error.{rank}").write_text(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        os._exit(1)
    # Everything is saved: end without the interpreter's teardown, where a gloo process group still held by an
    # object that outlived the body (DDP's reducer) is destroyed with its threads running and aborts the rank
    # ("terminate called without an active exception": twice in about 60 runs of ZeRO-1's check, each after
    # destroy_process_group; none in 80 runs since)
    os._exit(0)


def _run_specs(rank: int, specs: list[RunSpec], out: str, progress) -> None:
    """The executor's rank body: every spec in turn."""
    cache: dict[tuple[int, ...], object] = {}
    for index, spec in enumerate(specs):
        progress[2 * rank] = index
        groups = _groups(spec, rank, cache)
        _run_spec(rank, spec, os.path.join(out, f"{index}.{rank}.pt"), progress, groups)


def _groups(spec: RunSpec, rank: int, cache: dict[tuple[int, ...], object]) -> dict[str, object]:
    """This rank's process groups: ``pipeline`` (its replica's ranks, for the gradient norm) and ``stage{s}`` (the
    replicas of stage s, for its all-reduce; stages on one device share one). Every rank creates every group in the
    same order, as ``dist.new_group`` requires; one world runs without subgroups."""
    devices, width = spec.schedule.num_devices, spec.data_parallel
    if width == 1:
        return {"pipeline": None}

    def group(ranks: tuple[int, ...]) -> object:
        if ranks not in cache:
            cache[ranks] = dist.new_group(list(ranks))
        return cache[ranks]

    pipelines = [group(tuple(r * devices + d for d in range(devices))) for r in range(width)]
    groups = {"pipeline": pipelines[rank // devices]}
    for stage, home in enumerate(spec.schedule.stage_to_device):
        groups[f"stage{stage}"] = group(tuple(r * devices + home for r in range(width)))
    return groups


def _run_spec(rank: int, spec: RunSpec, path: str, progress, groups: dict[str, object]) -> None:
    """Warm-up and measured runs of one schedule on this rank; rows, losses, gradients, weights and the memory of
    the first run saved to ``path``."""
    fsdp = spec.zero == 3 and not spec.reshard_after_forward  # torch's runtime adds its FSDP actions first
    program = lower(add_fsdp_actions(spec.schedule) if fsdp else spec.schedule)
    cuda = spec.device == "cuda"
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    state = Rank(spec, rank, program, groups, device)
    actions = [a for a in program.device_actions[state.index] if a is not None]
    points = step_points(actions, state.rule.update, state.rule.microbatches)
    clock = state.clock
    runs, all_rows, losses, memory, cpu = spec.warmup + spec.iterations, [], [], None, []
    for run in range(runs):
        state.reset(last_run=spec.numerics and run == runs - 1)
        state.tracker.active = run == 0 and not cuda
        if run == 0 and cuda:
            cuda_reset(device)
        dist.barrier()
        clock.begin()
        cpu_start = time.process_time_ns()  # every thread of the rank: gloo's too, not just the ops
        rows = []
        for step, action in enumerate(actions):
            progress[2 * rank + 1] = step
            _maybe_fail(spec, rank, step)
            rows += state.wait_inputs(action)
            start = clock.stamp()
            state.run(action)
            if action.kind not in RECEIVES:  # a receive's row is its wait's (``wait_inputs``)
                rows.append((str(action), action.kind.value, action.stage, action.microbatch, start, clock.stamp()))
            rows += state.after(step, points)
        progress[2 * rank + 1] = len(actions)
        rows += state.finish()
        cpu.append(time.process_time_ns() - cpu_start)
        if run == 0:
            memory = cuda_peak(device) if cuda else state.tracker.result
            state.tracker.active = False
        all_rows.append(clock.resolve(rows))
        losses += [float(loss) for loss in state.losses]
    numerics = {"grads": {k: g.cpu() for k, g in state.grads.items()}, "weights": state.weights()} if \
        spec.numerics else {"grads": {}, "weights": {}}
    torch.save({"rows": all_rows[spec.warmup:], "cpu_ns": cpu[spec.warmup:], "losses": losses, **numerics,
                "memory": dataclasses.asdict(memory), "versions": state.seen}, path)


def _maybe_fail(spec: RunSpec, rank: int, step: int) -> None:
    if spec.inject is not None and spec.inject[1:] == (rank, step):
        if spec.inject[0] == "exit":
            os._exit(7)
        time.sleep(10**6)


# The launcher --------------------------------------------------------------------------------------------------------

def execute(spec: RunSpec) -> RunResult:
    """Run ``spec`` on ``schedule.num_devices x data_parallel`` spawned ranks (gloo on 127.0.0.1); see
    ``execute_all``."""
    return execute_all([spec])[0]


def execute_timed(spec: RunSpec) -> RunResult:
    """``execute`` for timing: no gradients or weights kept for the numerics tests (their copies before the last run's
    steps would fall inside its timeline, and a model's worth of them is gigabytes to save)."""
    return execute(dataclasses.replace(spec, numerics=False))


def execute_all(specs: list[RunSpec]) -> list[RunResult]:
    """Run the specs one after another in one launch (3-5 s each saved), all on the same number of ranks.

    Raises:
        RunError: a rank exited with an error or no rank made progress for ``timeout_s``; every rank is killed.
        ValueError: a spec the executor cannot run (one line naming the field), or specs on different rank counts
            or devices.
    """
    for spec in specs:
        spec.check()
        mismatch = p2p_order_mismatch(lower(spec.schedule)) if spec.device == "cuda" else None
        if mismatch:
            raise ValueError(f"{spec.schedule.name} on nccl: {mismatch}, expected the same order (nccl has no tags)")
    world = specs[0].world
    if any(spec.world != world or spec.device != specs[0].device for spec in specs):
        raise ValueError("execute_all: every spec must run on the same number of ranks (devices x data_parallel) "
                         "and the same device")
    with tempfile.TemporaryDirectory() as out:
        launch(world, "nccl" if specs[0].device == "cuda" else "gloo", _run_specs, specs, Path(out), _where(specs),
               lambda index: specs[index].timeout_s)
        return [_collect(Path(out), index, spec) for index, spec in enumerate(specs)]


def launch(world: int, backend: str, body: Callable, payload: object, out: Path,
           where: Callable[[int, int, int], str], timeout_s: Callable[[int], float]) -> None:
    """Spawn ``world`` ranks (one process group on 127.0.0.1, one thread each) that run
    ``body(rank, payload, str(out), progress)``, and supervise them until every rank has ended.

    ``body`` (a module-level function) sets ``progress[2 * rank]`` to the part it runs (a spec, a case) and
    ``progress[2 * rank + 1]`` to its step there; ``where(rank, part, step)`` names that for an error and
    ``timeout_s(part)`` is how long no rank may move. Every rank is killed and reaped on the way out.

    Raises:
        RunError: a rank exited with an error or no rank made progress in time.
    """
    context = mp.get_context("spawn")
    progress = context.Array("i", [0, -1] * world, lock=False)  # per rank: (part, step); -1 starting up
    port = free_port()
    ranks = [context.Process(target=_worker, args=(r, world, port, backend, body, payload, str(out), progress),
                             daemon=True) for r in range(world)]
    for process in ranks:
        process.start()
    try:
        _supervise(ranks, progress, out, where, timeout_s)
    finally:
        for process in ranks:
            if process.is_alive():
                process.kill()
            process.join()


def _collect(out: Path, index: int, spec: RunSpec) -> RunResult:
    """One spec's result from its ranks' files: losses summed over the last stage's ranks and averaged over the
    replicas; gradients from replica 0; weights per replica."""
    parts = [torch.load(out / f"{index}.{r}.pt") for r in range(spec.world)]
    devices, width = spec.schedule.num_devices, spec.data_parallel
    losses = [sum(part["losses"][i] for part in parts) / width for i in range(len(parts[0]["losses"]))]
    grads = {name: g for part in parts[:devices] for name, g in part["grads"].items()}
    weights = [{name: t for part in parts[r * devices:(r + 1) * devices] for name, t in part["weights"].items()}
               for r in range(width)]
    rows = [[part["rows"][i] for part in parts] for i in range(spec.iterations)]
    cpu = [[part["cpu_ns"][i] for part in parts] for i in range(spec.iterations)]
    memory = [RankMemory(**part["memory"]) for part in parts]
    return RunResult(rows, losses, grads, weights, memory, [part["versions"] for part in parts], spec.world, cpu)


def _where(specs: list[RunSpec]) -> Callable[[int, int, int], str]:
    """Names a rank's step of a spec: its action and the schedule."""
    programs = [lower(spec.schedule) for spec in specs]

    def where(r: int, index: int, step: int) -> str:
        program = programs[index]
        actions = [a for a in program.device_actions[r % program.num_devices] if a is not None]
        what = (f"step {step}, {actions[step]}" if 0 <= step < len(actions) else
                "its start (spawn, process group, building its stages)" if step < 0 else "the end of its program")
        return f"{what} of {specs[index].schedule.name}"
    return where


def _supervise(ranks: list, progress, out: Path, where_step: Callable[[int, int, int], str],
               timeout_s: Callable[[int], float]) -> None:
    """Wait for every rank; RunError naming the first that died, or a stuck one when nothing moves for the
    part's timeout."""

    def where(r: int) -> str:
        error = out / f"error.{r}"
        return where_step(r, progress[2 * r], progress[2 * r + 1]) + (f": {error.read_text()}" if error.is_file()
                                                                       else "")

    def died() -> RunError | None:
        """The rank that caused a failure: one that ended without raising (exited or killed) before one that
        raised, and among those that raised the first to write its error; its peers only fail after it (a
        connection reset). None while every rank is alive or ended well."""
        dead = [r for r, p in enumerate(ranks) if p.exitcode not in (None, 0)]
        if not dead:
            return None
        time.sleep(0.2)  # the peers of a dead rank fail within moments; wait for them before choosing
        errors = {r: out / f"error.{r}" for r in dead}
        first = min(dead, key=lambda r: (errors[r].is_file(),
                                          errors[r].stat().st_mtime_ns if errors[r].is_file() else 0, r))
        return RunError(f"rank {first} died (exit code {ranks[first].exitcode}) at {where(first)}")

    last, moved = list(progress), time.monotonic()
    while any(p.is_alive() for p in ranks):
        if (error := died()) is not None:
            raise error
        starting = any(progress[2 * r + 1] < 0 for r in range(len(ranks)))
        # Starting (importing torch, building the model) is not the program: it has a limit of its own
        limit = max(STARTUP_S, timeout_s(0)) if starting else timeout_s(progress[0])
        if list(progress) != last:
            last, moved = list(progress), time.monotonic()
        elif time.monotonic() - moved > limit:
            stuck = "; ".join(f"rank {r} at {where(r)}" for r, p in enumerate(ranks) if p.is_alive())
            raise RunError(f"hung: no rank made progress for {limit:g} s: {stuck}")
        time.sleep(0.05)
    if (error := died()) is not None:
        raise error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
