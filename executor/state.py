"""One rank of the real executor: its stages, the model cut into them, its data, and what each action does.

F runs the stage's modules (the embedding on stage 0, its blocks, the output layer and loss on the last stage) with
the weight version the update rule gives it (``executor.weights``); SEND/RECV are ``isend``/``irecv`` tagged by
action; I runs the backward with the stage's Linears deferred and keeps their (input, output gradient) pairs; W
computes the weight gradients from them; B is both. After a stage's last backward of an update group its gradients
are all-reduced (averaged) over its data-parallel replicas, and, when the schedule has no flush (PipeDream, 2BW),
the stage steps right there; flush schedules step every stage after the program (``finish``). Every tensor the rank
keeps is held in a ``MemoryTracker`` while tracking is on.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn

from pipescope.executor.clock import make_clock
from pipescope.executor.memory import MemoryTracker
from pipescope.executor.zero import ShardedStageWeights
from pipescope.executor.weights import (StageWeights, UpdateRule, clip_coefficient, optimizer_tensors,
                                                   squared_norm)
from pipescope.calibration.model import Block, Embedding, OutputLayer
from pipescope.calibration.presets import Shape
from pipescope.simulator.ir import Action, ActionKind, Schedule
from pipescope.simulator.models import stage_layers

if TYPE_CHECKING:
    from pipescope.executor.spec import RunSpec

K = ActionKind
Row = tuple[str, str, int, int, int, int]  # action, kind, stage, microbatch, start_ns, end_ns


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


def global_microbatch(replica: int, microbatch: int, m: int, replicas: int) -> int:
    """Where replica r's microbatch j sits in the whole batch: iteration j // m takes w*m microbatches, replica r
    the r-th m of them."""
    return (microbatch // m) * replicas * m + replica * m + microbatch % m


class Rank:
    """One device's stages and the state its program's actions pass along."""

    def __init__(self, spec: RunSpec, rank: int, program: Schedule, groups: dict[str, object], device: torch.device):
        self.spec, self.program, self.groups, self.device = spec, program, groups, device
        self.replica, self.index = divmod(rank, program.num_devices)
        self.offset = self.replica * program.num_devices  # this replica's rank of device 0
        self.home = program.stage_to_device
        self.last_stage = program.num_stages - 1
        self.rule = UpdateRule.of(program.weight_update, program.num_microbatches, program.iterations)
        self.parts = stage_modules(spec.shape, program.num_stages, spec.layers_per_stage)
        mine = [s for s in range(program.num_stages) if self.home[s] == self.index]
        modules = {i: m.to(device) for i, m in
                   build_modules(spec.shape, spec.seed, {i for s in mine for i in self.parts[s]}).items()}
        self.stages = {s: self._weights(s, {i: modules[i] for i in self.parts[s]}) for s in mine}
        m, w = program.num_microbatches, spec.data_parallel
        data = batch(spec.shape, spec.microbatch_size, program.total_microbatches * w, spec.seed)
        self.data = [tuple(t.to(device) for t in data[global_microbatch(self.replica, j, m, w)])
                     for j in range(program.total_microbatches)]
        self.split = {(a.stage, a.microbatch) for acts in program.device_actions for a in acts
                      if a is not None and a.kind is K.I}
        self.clock = make_clock(device, spec.cpu_time)
        self.tracker = MemoryTracker(time.perf_counter_ns)
        for stage in self.stages.values():
            self._hold_static(stage.held_weights, stage)
            self.tracker.hold(stage.held_grad, "gradients", ("gradients", id(stage)))
        self.grads: dict[str, torch.Tensor] = {}
        self.gathered: dict[int, torch.Tensor] = {}  # ZeRO-3: stage -> its weights while gathered whole

    def _weights(self, stage: int, modules: dict[int, nn.Module]) -> StageWeights:
        """A stage's weights, gradients and optimizer: whole, or sharded over its replicas (``RunSpec.zero``)."""
        spec = self.spec
        if not spec.zero:
            return StageWeights(modules, spec.optimizer, spec.lr)
        return ShardedStageWeights(modules, spec.optimizer, spec.lr, spec.zero, self.groups.get(f"stage{stage}"),
                                   self.replica, spec.data_parallel, spec.reshard_after_forward)

    def _hold_static(self, weights: list[torch.Tensor], stage: StageWeights) -> None:
        for t in weights:
            self.tracker.hold(t, "weights", ("weights", id(stage)))
        for t in optimizer_tensors(stage.optimizer):
            self.tracker.hold(t, "optimizer", ("optimizer", id(stage)))

    def reset(self, last_run: bool) -> None:
        """Before each run of the program: empty the per-run state; ``last_run`` keeps the final gradients."""
        self.last_run = last_run
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.received: dict[Action, tuple[torch.Tensor, object, object]] = {}  # buffer, work, when posted
        self.arrived: dict[Action, torch.Tensor] = {}
        self.sends: list[object] = []
        self.sent: list[Action] = []
        self.reducing: dict[int, tuple] = {}
        self.weight_work: dict[tuple[int, int], list] = {}
        self.seen: list[tuple[str, int, int, int, int, int]] = []
        self.losses = [0.0] * self.program.iterations
        for stage in self.stages.values():
            stage.base = stage.latest
            stage.updates = 0

    def run(self, action: Action) -> None:
        getattr(self, f"_{action.kind.value.lower()}", _nothing)(action)

    def wait_inputs(self, action: Action) -> list[Row]:
        """Wait for the transfer ``action`` consumes, before its timer starts: an op's time is its compute, and
        the wait shows as the gap before it, as in the simulator's timeline. The receive's row spans its post to the
        wait's return: gloo's receives complete only in ``wait``, so that is the latest the data can have arrived
        (the moment it did when the rank had to wait for it)."""
        kind = {K.F: K.RECV_F, K.I: K.RECV_B, K.B: K.RECV_B}.get(action.kind)
        recv = Action(action.stage, kind, action.microbatch) if kind is not None else None
        if recv not in self.received:
            return []
        buffer, work, posted = self.received.pop(recv)
        work.wait()
        self.arrived[recv] = buffer
        return [(str(recv), recv.kind.value, recv.stage, recv.microbatch, posted, self.clock.stamp())]

    # Compute --------------------------------------------------------------------------------------------------------

    def _f(self, a: Action) -> None:
        gathered = self._unshard(a)
        ids, targets = self.data[a.microbatch]
        stage = self.stages[a.stage]
        version = stage.forward_version(a.microbatch, self.rule.lagged_version(stage.base, a.microbatch))
        if a.stage == 0:
            x = ids
        else:
            if self.home[a.stage - 1] == self.index:  # the previous stage is here (a V's turn): no transfer
                x = self.outputs[a.stage - 1, a.microbatch].detach().requires_grad_()
            else:
                x = self.arrived.pop(Action(a.stage, K.RECV_F, a.microbatch)).requires_grad_()
            self.tracker.hold(x, "saved", ("in", a.stage, a.microbatch))
        self.inputs[a.stage, a.microbatch] = x
        tensors = stage.versions[version]
        self._see("F", a, version, tensors)
        recompute = self.program.recompute  # keep only the stage input: no graph, nothing saved
        x = self._forward(a, tensors, x, targets, grad=not recompute)
        if a.stage == self.last_stage:
            # kept on the device, read after the run: an .item() here would wait for the GPU inside F's timing
            self.losses[a.microbatch // self.program.num_microbatches] += x.detach().double() / \
                self.program.num_microbatches
            x = x / self.rule.loss_divisor
        self.outputs[a.stage, a.microbatch] = x
        self.tracker.hold(x, "outputs", ("out", a.stage, a.microbatch))
        self.tracker.release(("recv", Action(a.stage, K.RECV_F, a.microbatch)))
        if gathered:
            self._reshard(a)

    def _forward(self, a: Action, tensors: list[torch.Tensor], x: torch.Tensor, targets: torch.Tensor,
                 grad: bool) -> torch.Tensor:
        """The stage's modules on ``x`` with a version's ``tensors``: with autograd (its saved tensors tracked, the
        Linears deferred when the program splits this backward into I and W), or under no_grad (recompute's F)."""
        stage = self.stages[a.stage]
        deferrable = [m for i in self.parts[a.stage] if hasattr(m := stage.modules[i], "store")]
        split = (a.stage, a.microbatch) in self.split
        for module in deferrable:
            module.store.deferring = split
        with self.tracker.saving() if grad else torch.no_grad():
            for index in self.parts[a.stage]:
                extra = (targets,) if index == self.spec.shape.layers + 1 else ()
                x = stage.call(index, tensors, x, *extra)
        for module in deferrable:
            module.store.deferring = False
        return x

    def _see(self, kind: str, a: Action, version: int, tensors: list[torch.Tensor]) -> None:
        """Which weight version an F or a backward ran against, the newest then, and the buffer's in-place write
        count (``_version`` of its first tensor: a step, or a copy into a reused buffer, writes every tensor): a
        backward must see the version, and the very values, its forward saw."""
        newest = self.stages[a.stage].latest
        self.seen.append((kind, a.stage, a.microbatch, version, newest, tensors[0]._version))

    def _backward(self, a: Action) -> None:
        gathered = self._unshard(a)
        stage = self.stages[a.stage]
        version = stage.used[a.microbatch]
        self._see("B", a, version, stage.versions[version])
        out = self.outputs.pop((a.stage, a.microbatch))
        if self.program.recompute:  # the forward again, from the stage input, with the version the F used
            out = self._forward(a, stage.versions[version], self.inputs[a.stage, a.microbatch],
                                self.data[a.microbatch][1], grad=True)
            if a.stage == self.last_stage:
                out = out / self.rule.loss_divisor
        local_next = a.stage != self.last_stage and self.home[a.stage + 1] == self.index
        recv = Action(a.stage, K.RECV_B, a.microbatch)
        if a.stage == self.last_stage:
            grad = None
        elif local_next:
            grad = self.inputs.pop((a.stage + 1, a.microbatch)).grad
        else:
            grad = self.arrived.pop(recv)
        whole = stage.open_grads()  # ZeRO-2: the op's whole gradients, reduce-scattered when it ends
        if whole is not None:
            self.tracker.hold(whole, "gradients", ("whole gradients", a.stage))
        torch.autograd.backward(out, grad)
        del out, grad
        stage.close_grads()
        if stage.grad is None:  # reduce-scattered into the shard
            self.tracker.release(("whole gradients", a.stage))
        stage.backward_done(a.microbatch)
        deferrable = [m for i in self.parts[a.stage] if hasattr(m := stage.modules[i], "store")]
        pending = [(m.store, [(x, g, self.tracker.original(w), b) for x, g, w, b in m.store.pending])
                   for m in deferrable]
        self.weight_work[a.stage, a.microbatch] = pending
        for module in deferrable:
            module.store.pending = []
        for _, pairs in pending:
            for x, grad_out, _, _ in pairs:
                self.tracker.hold(x, "saved", ("W", a.stage, a.microbatch))
                self.tracker.hold(grad_out, "saved", ("W", a.stage, a.microbatch))
        x = self.inputs.get((a.stage, a.microbatch))
        if x is not None and x.grad is not None:
            self.tracker.hold(x.grad, "p2p", ("in", a.stage, a.microbatch))
        for token in (("out", a.stage, a.microbatch), ("recv", recv), ("in", a.stage + 1, a.microbatch)):
            self.tracker.release(token)
        if gathered:
            self._reshard(a)

    _i = _b = _backward

    # ZeRO-3's gathers: per op, or at torch's FSDP actions (``executor.zero``) ---------------------------------------

    def _unshard(self, a: Action) -> bool:
        """The stage's whole weights gathered, unless they are already (by its UNSHARD); True when gathered here."""
        whole = self.stages[a.stage].unshard()
        if whole is not None:
            self.tracker.hold_gathered(whole, ("whole weights", a.stage))
            self.gathered[a.stage] = whole
        return whole is not None

    def _reshard(self, a: Action) -> None:
        whole = self.gathered.pop(a.stage, None)
        if whole is not None:  # released before its storage is freed: its address is the tracker's key
            self.tracker.release_gathered(whole, ("whole weights", a.stage))
        self.stages[a.stage].reshard()

    def _reduce_grad(self, a: Action) -> None:
        self.stages[a.stage].reduce_grad()
        self.tracker.release(("whole gradients", a.stage))

    def _w(self, a: Action) -> None:
        with torch.no_grad():  # the weight gradients are not differentiated further
            for store, pending in self.weight_work.pop((a.stage, a.microbatch)):
                store.pending = pending
                store.run()
        self.tracker.release(("W", a.stage, a.microbatch))

    # Transfers ------------------------------------------------------------------------------------------------------

    def _send_f(self, a: Action) -> None:
        out = self.outputs[a.stage, a.microbatch]
        self._send(out.detach().contiguous(), self.home[a.stage + 1], a)

    def _send_b(self, a: Action) -> None:
        grad = self.inputs.pop((a.stage, a.microbatch)).grad
        self._send(grad.contiguous(), self.home[a.stage - 1], a)
        self.tracker.release(("in", a.stage, a.microbatch))

    def _send(self, tensor: torch.Tensor, peer: int, a: Action) -> None:
        """torch's isend: the rank goes on, and every send is waited for at the end of the run (as torch's runtime
        does), so the tensor is held until then."""
        self.sends.append(dist.isend(tensor, self.offset + peer, tag=_tag(a)))
        self.sent.append(a)
        self.tracker.hold(tensor, "p2p", ("send", a))

    def _recv_f(self, a: Action) -> None:
        self._post(a, Action(a.stage - 1, K.SEND_F, a.microbatch), self.home[a.stage - 1])

    def _recv_b(self, a: Action) -> None:
        self._post(a, Action(a.stage + 1, K.SEND_B, a.microbatch), self.home[a.stage + 1])

    def _post(self, a: Action, send: Action, peer: int) -> None:
        shape = (self.spec.microbatch_size, self.spec.shape.seq, self.spec.shape.hidden)
        buffer = torch.empty(shape, device=self.device)
        posted = self.clock.stamp()
        self.received[a] = (buffer, dist.irecv(buffer, self.offset + peer, tag=_tag(send)), posted)
        self.tracker.hold(buffer, "p2p", ("recv", a))

    # Gradient sync and the optimizer --------------------------------------------------------------------------------

    def after(self, step: int, points: dict[int, list[tuple[int, int]]]) -> list[Row]:
        """What follows program step ``step``: the all-reduce of each stage whose gradients are complete (when
        w > 1), and under PipeDream and 2BW that stage's step."""
        rows = []
        for stage, group in points.get(step, ()):
            if self.spec.data_parallel > 1:
                self._reduce(stage, group)
            if self.rule.inline:
                rows += self._reduced(stage)
                norm = squared_norm([self.stages[stage].grad])
                rows.append(self._step(stage, group, clip_coefficient(norm, self.spec.clip_norm)))
        return rows

    def _reduce(self, stage: int, group: int) -> None:
        """Start the average of the stage's gradient buffer over its replicas (in place, like DDP's buckets), or
        under ZeRO its reduce-scatter (``executor.zero``)."""
        ended: list[int] = []
        start = self.clock.stamp()  # on a GPU an event: when the device reaches the launch, not when the host does
        weights = self.stages[stage]
        if isinstance(weights, ShardedStageWeights):
            self.reducing[stage] = (weights.start_reduce(), None, group, start, ended)
            return
        work = dist.all_reduce(self.stages[stage].grad, group=self.groups[f"stage{stage}"], async_op=True)
        stamped = work.get_future().then(lambda _: ended.append(time.perf_counter_ns()))
        self.reducing[stage] = (work, stamped, group, start, ended)

    def _reduced(self, stage: int) -> list[Row]:
        """Wait for the stage's all-reduce, if one runs; its row spans launch to completion."""
        if stage not in self.reducing:
            return []
        work, stamped, group, start, ended = self.reducing.pop(stage)
        k = self.rule.last_microbatch(group)
        weights = self.stages[stage]
        if isinstance(weights, ShardedStageWeights):  # a row for ZeRO-1's one reduce-scatter: launch to averaged
            weights.finish_reduce(work)
            return [] if work is None else [(str(Action(stage, K.REDUCE_SCATTER, k)), K.REDUCE_SCATTER.value, stage,
                                             k, start, self.clock.stamp())]
        work.wait()
        if self.clock.wall:  # gloo completes it when the reduction ends, which may be long before this wait
            stamped.wait()
            end = ended[0]
        else:  # nccl completes the future at launch: the end is an event on the stream that now waits for the
            end = self.clock.stamp()  # reduction; CPU time: this thread's, as the start (gloo's callback has none)
        self.stages[stage].grad.div_(self.spec.data_parallel)
        return [(str(Action(stage, K.ALL_REDUCE, k)), K.ALL_REDUCE.value, stage, k, start, end)]

    def _step(self, stage: int, group: int, coefficient: float) -> Row:
        """One stage's optimizer step, timed: the clipping scale, ``step()``, zeroing the gradient buffer."""
        weights = self.stages[stage]
        weights.updates += 1
        if self.last_run and weights.updates == self.rule.steps_per_run:
            self.grads.update(weights.named(weights.full_grads()))
        start = self.clock.stamp()
        created = weights.step(coefficient, lagged=self.rule.lagged)
        end = self.clock.stamp()
        for t in created:
            self.tracker.hold(t, "weights", ("weights", id(weights)))
        k = self.rule.last_microbatch(group)
        return (str(Action(stage, K.OPT, k)), K.OPT.value, stage, k, start, end)

    def finish(self) -> list[Row]:
        """End of a run of the program: wait for the sends; for flush schedules, the all-reduces, the gradient norm
        over the pipeline (squared norms all-reduced over this replica's ranks) and every stage's step."""
        for work in self.sends:
            work.wait()
        self.sends = []  # the works hold the tensors
        for a in self.sent:
            self.tracker.release(("send", a))
        if self.rule.inline:
            return []
        rows = [row for stage in sorted(self.stages) for row in self._reduced(stage)]
        if self.spec.zero:  # each rank holds a shard of each of its stages: the norm is over every rank
            squares, group = sum(s.squared_norm() for s in self.stages.values()), None
        else:
            squares, group = squared_norm([s.grad for s in self.stages.values()]), self.groups["pipeline"]
        squared = torch.tensor([squares], dtype=torch.float64, device=self.device)
        start = self.clock.stamp()
        dist.all_reduce(squared, group=group)
        k = self.rule.last_microbatch(0)  # stage -1: the pipeline's, named as the simulator names its collective
        rows.append((str(Action(-1, K.ALL_REDUCE, k)), K.ALL_REDUCE.value, -1, k, start, self.clock.stamp()))
        coefficient = clip_coefficient(float(squared), self.spec.clip_norm)
        return rows + [self._step(stage, 0, coefficient) for stage in sorted(self.stages)]

    def weights(self) -> dict[str, torch.Tensor]:
        """Every parameter's newest value by name."""
        return {name: t.cpu() for s in self.stages.values() for name, t in s.named(s.whole_weights()).items()}


def _nothing(_: Action) -> None:
    """An action a rank has no work for (its collectives and steps run in ``after`` and ``finish``)."""


def _tag(send: Action) -> int:
    """A tag per transfer, from the SEND it is: (stage, kind, microbatch) as one integer gloo accepts."""
    return (send.stage * 2 + (send.kind is K.SEND_B)) * (1 << 20) + send.microbatch
