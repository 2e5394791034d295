"""The real executor: the lowered program the simulator replays, run for real over torch.distributed processes.

Each rank runs its device's list of the program ``simulator.lowering.lower`` makes, action by action, on the GPT
pieces of ``calibration.model``: F runs its stage's layers (the embedding on stage 0, the output layer and loss on
the last), SEND/RECV are ``isend``/``irecv`` of activations and input gradients (tagged by action, so pairs match
whatever the order), I runs the backward with the stage's Linears deferred (input gradients only, the weight-
gradient pairs kept), W computes the weight gradients from what that microbatch's I kept, and B is both at once.
Interleaved and V-shaped stage maps need nothing special: a stage lives where ``stage_to_device`` says.

Every module is built from its own seed (``build_modules``), so the ranks and the one-process reference
(``reference_step``) start from the same weights and the numerics tests compare loss and gradients exactly.
Start and end of every action are ``perf_counter_ns`` after a barrier (one clock on one machine). A rank that
dies or stops making progress ends the run with one line naming it and its action, and no process is left.
Flush schedules only: PipeDream's and 2BW's weight versions, data parallelism and the optimizer step are not run.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from pipescope.calibration.model import Block, Embedding, OutputLayer
from pipescope.calibration.presets import Shape
from pipescope.simulator.ir import Action, ActionKind, Schedule, WeightUpdate
from pipescope.simulator.lowering import lower
from pipescope.simulator.models import stage_layers

K = ActionKind


@dataclass(frozen=True)
class RunSpec:
    """What to run: the schedule, the model shape, the batch, how often, and a fault to inject (tests)."""

    schedule: Schedule
    shape: Shape
    microbatch_size: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    iterations: int = 1
    warmup: int = 0
    seed: int = 0
    timeout_s: float = 120.0
    inject: tuple[str, int, int] | None = None  # ("exit" | "hang", rank, step): a rank that dies or hangs there


@dataclass
class RunResult:
    """Per iteration, every rank's rows (action, kind, stage, microbatch, start_ns, end_ns); the last iteration's
    loss; each parameter's gradient by name (from the last iteration)."""

    rows: list[list[tuple[str, str, int, int, int, int]]]
    loss: float
    grads: dict[str, torch.Tensor]
    world: int


class RunError(RuntimeError):
    """A rank died or hung; the message is one line naming the rank and its action."""


# The model, cut into stages ------------------------------------------------------------------------------------------

def build_modules(shape: Shape, seed: int, wanted: set[int] | None = None) -> dict[int, nn.Module]:
    """Module index -> module (0 the embedding, 1..L the blocks, L+1 the output layer), each from its own seed, so any
    subset is bit-identical wherever it is built. ``wanted`` limits which are built."""
    builders = {0: lambda: Embedding(shape.vocab, shape.hidden, shape.seq),
                shape.layers + 1: lambda: OutputLayer(shape.hidden, shape.vocab)}
    modules = {}
    for index in range(shape.layers + 2):
        if wanted is not None and index not in wanted:
            continue
        torch.manual_seed(seed * 1_000_003 + index)
        modules[index] = builders[index]() if index in builders else Block(shape.hidden, shape.heads)
    return modules


def stage_modules(shape: Shape, stages: int, layers_per_stage: Sequence[int] | None) -> list[list[int]]:
    """Per stage, its module indices: the embedding on stage 0, the blocks in order, the output layer last."""
    counts = stage_layers(shape.layers, stages, layers_per_stage)
    first = [sum(counts[:s]) + 1 for s in range(stages)]
    parts = [list(range(first[s], first[s] + counts[s])) for s in range(stages)]
    parts[0].insert(0, 0)
    parts[-1].append(shape.layers + 1)
    return parts


def batch(shape: Shape, microbatch_size: int, microbatches: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    """Token ids and targets per microbatch, from ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(shape.vocab, (microbatch_size, shape.seq), generator=generator),
             torch.randint(shape.vocab, (microbatch_size, shape.seq), generator=generator))
            for _ in range(microbatches)]


def reference_step(spec: RunSpec) -> tuple[float, dict[str, torch.Tensor]]:
    """One-process training step over the same model and batch: the mean loss over microbatches and the gradients
    (what every flush schedule must reproduce)."""
    torch.set_num_threads(1)
    modules = build_modules(spec.shape, spec.seed)
    m = spec.schedule.num_microbatches
    total = 0.0
    for ids, targets in batch(spec.shape, spec.microbatch_size, m, spec.seed):
        x = modules[0](ids)
        for index in range(1, spec.shape.layers + 1):
            x = modules[index](x)
        loss = modules[spec.shape.layers + 1](x, targets) / m
        loss.backward()
        total += loss.item()
    return total, _grads(modules)


def _grads(modules: dict[int, nn.Module]) -> dict[str, torch.Tensor]:
    return {f"{index}.{name}": p.grad.detach().clone() for index, module in modules.items()
            for name, p in module.named_parameters() if p.grad is not None}


# One rank ------------------------------------------------------------------------------------------------------------

class Rank:
    """One device's stages and the state its program's actions pass along."""

    def __init__(self, spec: RunSpec, rank: int, program: Schedule):
        self.spec, self.rank, self.program = spec, rank, program
        self.home = program.stage_to_device
        self.last_stage = program.num_stages - 1
        self.parts = stage_modules(spec.shape, program.num_stages, spec.layers_per_stage)
        mine = [s for s in range(program.num_stages) if self.home[s] == rank]
        self.modules = build_modules(spec.shape, spec.seed, {i for s in mine for i in self.parts[s]})
        self.data = batch(spec.shape, spec.microbatch_size, program.total_microbatches, spec.seed)
        self.split = {(a.stage, a.microbatch) for acts in program.device_actions for a in acts
                      if a is not None and a.kind is K.I}

    def reset(self) -> None:
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.received: dict[Action, tuple[torch.Tensor, object]] = {}
        self.arrived: dict[Action, torch.Tensor] = {}
        self.sends: list[object] = []
        self.weight_work: dict[tuple[int, int], list] = {}
        self.loss = 0.0
        for module in self.modules.values():
            module.zero_grad(set_to_none=True)

    def run(self, action: Action) -> None:
        getattr(self, f"_{action.kind.value.lower()}", _nothing)(action)

    def wait_inputs(self, action: Action) -> None:
        """Wait for the transfer ``action`` consumes, before its timer starts: an op's time is its compute, and
        the wait shows as the gap before it, as in the simulator's timeline."""
        kind = {K.F: K.RECV_F, K.I: K.RECV_B, K.B: K.RECV_B}.get(action.kind)
        recv = Action(action.stage, kind, action.microbatch) if kind is not None else None
        if recv in self.received:
            buffer, work = self.received.pop(recv)
            work.wait()
            self.arrived[recv] = buffer

    def _f(self, a: Action) -> None:
        ids, targets = self.data[a.microbatch]
        if a.stage == 0:
            x = ids
        elif self.home[a.stage - 1] == self.rank:  # the previous stage is here (a V's turn): no transfer
            x = self.outputs[a.stage - 1, a.microbatch].detach().requires_grad_()
        else:
            x = self._wait(Action(a.stage, K.RECV_F, a.microbatch)).requires_grad_()
        self.inputs[a.stage, a.microbatch] = x
        deferrable = [m for i in self.parts[a.stage] if hasattr(m := self.modules[i], "store")]
        split = (a.stage, a.microbatch) in self.split
        for module in deferrable:
            module.store.deferring = split
        for index in self.parts[a.stage]:
            module = self.modules[index]
            x = module(x, targets) if index == self.spec.shape.layers + 1 else module(x)
        for module in deferrable:
            module.store.deferring = False
        if a.stage == self.last_stage:
            x = x / self.program.num_microbatches
            self.loss += x.item()
        self.outputs[a.stage, a.microbatch] = x

    def _backward(self, a: Action) -> None:
        out = self.outputs.pop((a.stage, a.microbatch))
        if a.stage == self.last_stage:
            grad = None
        elif self.home[a.stage + 1] == self.rank:
            grad = self.inputs.pop((a.stage + 1, a.microbatch)).grad
        else:
            grad = self._wait(Action(a.stage, K.RECV_B, a.microbatch))
        torch.autograd.backward(out, grad)
        deferrable = [m for i in self.parts[a.stage] if hasattr(m := self.modules[i], "store")]
        self.weight_work[a.stage, a.microbatch] = [(m.store, m.store.pending) for m in deferrable]
        for module in deferrable:
            module.store.pending = []

    _i = _b = _backward

    def _w(self, a: Action) -> None:
        for store, pending in self.weight_work.pop((a.stage, a.microbatch)):
            store.pending = pending
            store.run()

    def _send_f(self, a: Action) -> None:
        out = self.outputs[a.stage, a.microbatch]
        self._send(out.detach().contiguous(), self.home[a.stage + 1], a)

    def _send_b(self, a: Action) -> None:
        grad = self.inputs.pop((a.stage, a.microbatch)).grad
        self._send(grad.contiguous(), self.home[a.stage - 1], a)

    def _send(self, tensor: torch.Tensor, peer: int, a: Action) -> None:
        """torch's isend: the rank goes on, and every send is waited for at the end of the iteration."""
        self.sends.append(dist.isend(tensor, peer, tag=_tag(a)))

    def _recv_f(self, a: Action) -> None:
        self._post(a, Action(a.stage - 1, K.SEND_F, a.microbatch), self.home[a.stage - 1])

    def _recv_b(self, a: Action) -> None:
        self._post(a, Action(a.stage + 1, K.SEND_B, a.microbatch), self.home[a.stage + 1])

    def _post(self, a: Action, send: Action, peer: int) -> None:
        shape = (self.spec.microbatch_size, self.spec.shape.seq, self.spec.shape.hidden)
        buffer = torch.empty(shape)
        self.received[a] = (buffer, dist.irecv(buffer, peer, tag=_tag(send)))

    def _wait(self, recv: Action) -> torch.Tensor:
        return self.arrived.pop(recv)

    def finish(self) -> None:
        for work in self.sends:
            work.wait()


def _nothing(_: Action) -> None:
    """UNSHARD, RESHARD, REDUCE_GRAD: torch's per-stage bookkeeping, no work here."""


def _tag(send: Action) -> int:
    """A tag per transfer, from the SEND it is: (stage, kind, microbatch) as one integer gloo accepts."""
    return (send.stage * 2 + (send.kind is K.SEND_B)) * (1 << 20) + send.microbatch


def _worker(rank: int, world: int, port: int, specs: list[RunSpec], out: str, progress) -> None:
    """One rank: every spec in turn. An exception is written, one line, for the supervisor to report."""
    try:
        torch.set_num_threads(1)  # two threads per rank on two cores run 2-6x slower
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        for index, spec in enumerate(specs):
            progress[2 * rank] = index
            _run_spec(rank, spec, os.path.join(out, f"{index}.{rank}.pt"), progress)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as err:  # noqa: BLE001 (the rank ends here either way; the reason must reach the parent)
        Path(out, f"error.{rank}").write_text(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        os._exit(1)


def _run_spec(rank: int, spec: RunSpec, path: str, progress) -> None:
    """Warm-up and measured iterations of one schedule on this rank; rows, loss and gradients saved to ``path``."""
    program = lower(spec.schedule)
    state = Rank(spec, rank, program)
    actions = [a for a in program.device_actions[rank] if a is not None]
    all_rows = []
    for _ in range(spec.warmup + spec.iterations):
        state.reset()
        dist.barrier()
        rows = []
        for step, action in enumerate(actions):
            progress[2 * rank + 1] = step
            _maybe_fail(spec, rank, step)
            state.wait_inputs(action)
            start = time.perf_counter_ns()
            state.run(action)
            rows.append((str(action), action.kind.value, action.stage, action.microbatch, start,
                         time.perf_counter_ns()))
        state.finish()
        all_rows.append(rows)
    progress[2 * rank + 1] = len(actions)
    torch.save({"rows": all_rows[spec.warmup:], "loss": state.loss, "grads": _grads(state.modules)}, path)


def _maybe_fail(spec: RunSpec, rank: int, step: int) -> None:
    if spec.inject is not None and spec.inject[1:] == (rank, step):
        if spec.inject[0] == "exit":
            os._exit(7)
        time.sleep(10**6)


# The launcher --------------------------------------------------------------------------------------------------------

def execute(spec: RunSpec) -> RunResult:
    """Run ``spec`` on ``schedule.num_devices`` spawned ranks (gloo on 127.0.0.1); see ``execute_all``."""
    return execute_all([spec])[0]


def execute_all(specs: list[RunSpec]) -> list[RunResult]:
    """Run the specs one after another in one launch (3-5 s each saved), all on the same number of ranks.

    Raises:
        RunError: a rank exited with an error or no rank made progress for ``timeout_s``; every rank is killed.
        ValueError: a schedule the executor cannot run (weight versions), or specs on different rank counts.
    """
    for spec in specs:
        if spec.schedule.weight_update is not WeightUpdate.FLUSH:
            raise ValueError(f"schedule {spec.schedule.name!r}: the executor runs flush schedules only (weight "
                             f"versions are not implemented)")
    world = specs[0].schedule.num_devices
    if any(spec.schedule.num_devices != world for spec in specs):
        raise ValueError("execute_all: every schedule must run on the same number of ranks")
    context = mp.get_context("spawn")
    progress = context.Array("i", 2 * world, lock=False)  # per rank: (spec index, step)
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        ranks = [context.Process(target=_worker, args=(r, world, port, specs, out, progress), daemon=True)
                 for r in range(world)]
        for process in ranks:
            process.start()
        try:
            _supervise(ranks, progress, specs, Path(out))
        finally:
            for process in ranks:
                if process.is_alive():
                    process.kill()
                process.join()
        return [_collect(Path(out), index, spec, world) for index, spec in enumerate(specs)]


def _collect(out: Path, index: int, spec: RunSpec, world: int) -> RunResult:
    parts = [torch.load(out / f"{index}.{r}.pt") for r in range(world)]
    grads = {name: g for part in parts for name, g in part["grads"].items()}
    rows = [[part["rows"][i] for part in parts] for i in range(spec.iterations)]
    return RunResult(rows, sum(part["loss"] for part in parts), grads, world)


def _supervise(ranks: list, progress, specs: list[RunSpec], out: Path) -> None:
    """Wait for every rank; RunError naming the first that died, or a stuck one when nothing moves for the
    spec's timeout."""
    programs = [lower(spec.schedule) for spec in specs]

    def where(r: int) -> str:
        index, step = progress[2 * r], progress[2 * r + 1]
        actions = [a for a in programs[index].device_actions[r] if a is not None]
        what = f"step {step}, {actions[step]}" if step < len(actions) else "the end of its program"
        error = out / f"error.{r}"
        return f"{what} of {specs[index].schedule.name}" + (f": {error.read_text()}" if error.is_file() else "")

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
        if list(progress) != last:
            last, moved = list(progress), time.monotonic()
        elif time.monotonic() - moved > specs[progress[0]].timeout_s:
            stuck = "; ".join(f"rank {r} at {where(r)}" for r, p in enumerate(ranks) if p.is_alive())
            raise RunError(f"hung: no rank made progress for {specs[progress[0]].timeout_s:g} s: {stuck}")
        time.sleep(0.05)
    if (error := died()) is not None:
        raise error


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
