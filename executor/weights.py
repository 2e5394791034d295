"""Weights, gradients and the optimizer of one pipeline stage, for the executor and its one-process reference.

The update rule follows the schedule's ``WeightUpdate`` (docs/schedules.md sections 1-3):
- flush: one version; every forward uses it; one step per iteration after the whole program, with the gradient norm
  clipped over the whole pipeline (an all-reduce of squared norms over the ranks, as Megatron does);
- PipeDream (``async-stash``): a forward uses the newest version and stashes it, so the microbatch's backward uses
  the same one; each backward is its own step (its own loss, not divided by m), right after it;
- 2BW: microbatch j of global iteration T = j // m uses version max(T-1, 0); the stage steps after its last backward
  of each iteration, so W(t+1) = W(t) - lr * grad f(W(t-1)), with two versions held.
Asynchronous stages step at different times, so PipeDream and 2BW clip each stage's own norm (a pipeline-wide
all-reduce would make every stage wait for the slowest at each step).

A version is a set of tensors run through the stage's modules with ``torch.func.functional_call``; version 0 is the
modules' own parameters, so flush schedules run the modules as they are. A step writes the new version into a
buffer no microbatch needs any more (or a new one), so stage r holds p - r versions under PipeDream and 2 under
2BW, and the optimizer's state is moved onto whichever buffer it steps. Every version's gradients are views into one
flat buffer (Megatron's contiguous grad buffer: persistent, all-reduced in place between data-parallel replicas).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

from pipescope.simulator.ir import WeightUpdate
from pipescope.simulator.lowering import step_group, step_microbatch

OPTIMIZERS = ("adamw", "sgd")


@dataclass(frozen=True)
class UpdateRule:
    """When a stage steps and which version a forward uses."""

    update: WeightUpdate
    microbatches: int  # m
    steps_per_run: int  # updates per stage in one run of the program (per repetition)

    @classmethod
    def of(cls, update: WeightUpdate, microbatches: int, iterations: int) -> UpdateRule:
        per_run = iterations * microbatches if update is WeightUpdate.ASYNC_STASH else iterations
        return cls(update, microbatches, per_run)

    @property
    def per_microbatch(self) -> bool:
        return self.update is WeightUpdate.ASYNC_STASH

    @property
    def inline(self) -> bool:
        """Steps happen inside the program (no flush), after the stage's last backward of each update group."""
        return self.update is not WeightUpdate.FLUSH

    @property
    def lagged(self) -> bool:
        """2BW: forwards after a step still use the version before it, so a step never overwrites the newest."""
        return self.update is WeightUpdate.TWO_BW

    @property
    def loss_divisor(self) -> int:
        return 1 if self.per_microbatch else self.microbatches

    def group(self, microbatch: int) -> int:
        """The update a microbatch's gradient belongs to: its iteration, or itself under PipeDream."""
        return step_group(self.update, self.microbatches, microbatch)

    def last_microbatch(self, group: int) -> int:
        """The name an update group's rows carry (``{stage}OPT{k}``, ``{stage}ALL_REDUCE{k}``): its last microbatch,
        as the simulator names its steps and all-reduces."""
        return step_microbatch(self.update, self.microbatches, group)

    def lagged_version(self, base: int, microbatch: int) -> int | None:
        """2BW's version for ``microbatch`` of a run that started at version ``base`` (None: the newest)."""
        if not self.lagged:
            return None
        return max(base + microbatch // self.microbatches - 1, 0)


def make_optimizer(name: str, lr: float, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    """torch's AdamW (its default betas, eps and weight decay) or plain SGD, with its state created now (what the
    first ``step`` would create), so the state's memory is there from the start as in every later iteration."""
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    optimizer = torch.optim.AdamW(params, lr=lr)
    for p in params:  # torch.optim.Adam._init_group's lazy state, made eagerly (CPU, not fused, not capturable)
        optimizer.state[p] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p),
                              "exp_avg_sq": torch.zeros_like(p)}
    return optimizer


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]


def squared_norm(grads: list[torch.Tensor]) -> float:
    """Sum of squares: each buffer's norm in its own precision, as torch's ``clip_grad_norm_`` and Megatron compute
    it, then squared and summed in float64, so that the order of summation (per rank, then over ranks) barely
    matters. A float64 copy of the buffer would cost 20x the float32 norm (70 ms against 3.6 ms on 13M parameters,
    docs/validation.md "Larger ops and the host's share")."""
    return sum(float(torch.linalg.vector_norm(g)) ** 2 for g in grads)


def clip_coefficient(squared: float, max_norm: float | None) -> float:
    """torch's clip_grad_norm_ factor: max_norm / (norm + 1e-6), at most 1."""
    if max_norm is None:
        return 1.0
    return min(1.0, max_norm / (squared ** 0.5 + 1e-6))


class StageWeights:
    """One stage's weight versions, gradient buffer and optimizer (see the module doc)."""

    def __init__(self, modules: dict[int, nn.Module], optimizer: str, lr: float):
        self.modules = modules
        self.names = [(i, name) for i, module in modules.items() for name, _ in module.named_parameters()]
        own = [p for module in modules.values() for p in module.parameters()]
        self.own = own  # the modules' parameters: the buffer the modules run with as they are
        self.versions: dict[int, list[torch.Tensor]] = {0: own}
        self.latest = 0
        self.users: Counter[int] = Counter()  # version -> microbatches whose forward used it, backward not yet
        self.used: dict[int, int] = {}  # microbatch -> its version
        self.base = 0  # the newest version when the current run of the program started
        self.updates = 0  # steps in the current run
        self._make_state(optimizer, lr)

    def _make_state(self, optimizer: str, lr: float) -> None:
        """The flat gradient buffer (every parameter's gradient a view of it) and the optimizer over the
        parameters; ZeRO makes its own (``executor.zero``)."""
        self.grad = torch.zeros(sum(p.numel() for p in self.own), dtype=self.own[0].dtype, device=self.own[0].device)
        self._attach_grads(self.own)
        self.optimizer = make_optimizer(optimizer, lr, self.own)

    @property
    def held_grad(self) -> torch.Tensor:
        """The gradients the stage keeps between ops: its whole flat buffer."""
        return self.grad

    @property
    def held_weights(self) -> list[torch.Tensor]:
        """The weights the stage keeps between ops: every version's tensors are added as they are made."""
        return self.own

    def whole_weights(self) -> list[torch.Tensor]:
        """Every parameter's newest value."""
        return self.versions[self.latest]

    def full_grads(self) -> list[torch.Tensor]:
        """Every parameter's gradient (averaged over the replicas once reduced)."""
        return [p.grad for p in self.versions[self.latest]]

    # What ZeRO does at these points (``executor.zero``); nothing here, where every state is whole
    def open_grads(self) -> torch.Tensor | None:
        """Before a backward op: a buffer made for it (None: the gradients accumulate into ``grad``)."""
        return None

    def close_grads(self) -> None:
        """After a backward op."""

    def unshard(self) -> torch.Tensor | None:
        """Before an op that reads the weights, or at torch's UNSHARD: the whole weights gathered (None: whole)."""
        return None

    def reshard(self) -> None:
        """After such an op, or at torch's RESHARD."""

    def reduce_grad(self) -> None:
        """At torch's REDUCE_GRAD."""

    def _attach_grads(self, params: list[torch.Tensor]) -> None:
        offset = 0
        for p in params:
            p.grad = self.grad[offset:offset + p.numel()].view_as(p)
            offset += p.numel()

    def forward_version(self, microbatch: int, lagged: int | None) -> int:
        version = self.latest if lagged is None else lagged
        self.users[version] += 1
        self.used[microbatch] = version
        return version

    def backward_done(self, microbatch: int) -> None:
        self.users[self.used.pop(microbatch)] -= 1

    def call(self, index: int, tensors: list[torch.Tensor], *args: torch.Tensor) -> torch.Tensor:
        """Module ``index`` run with ``tensors`` (a version's buffer; the modules as they are for their own)."""
        module = self.modules[index]
        if tensors is self.own:
            return module(*args)
        params = {name: t for (i, name), t in zip(self.names, tensors) if i == index}
        return functional_call(module, params, args)

    def step(self, coefficient: float, lagged: bool) -> list[torch.Tensor]:
        """The next version: the newest minus the optimizer's step on the gradient (scaled by ``coefficient``), in
        place when no microbatch and no later forward needs the newest (flush, PipeDream's last stage), else into a
        free buffer or a new one. The gradient is zeroed. Returns the new buffer's tensors when it is a new one."""
        newest = self.versions[self.latest]
        if not lagged and self.users[self.latest] == 0:
            target, created = self.versions.pop(self.latest), []
        else:
            free = [v for v in self.versions if v < self.latest and self.users[v] == 0]
            if free:
                target, created = self.versions.pop(free[0]), []
            else:
                target = [p.detach().clone().requires_grad_() for p in newest]
                self._attach_grads(target)
                created = target
            with torch.no_grad():
                for t, p in zip(target, newest):
                    t.copy_(p)
            self._move_state(target)
        with torch.no_grad():
            if coefficient != 1.0:
                self.grad.mul_(coefficient)
            self.optimizer.step()
            self.grad.zero_()
        self.latest += 1
        self.versions[self.latest] = target
        return created

    def _move_state(self, target: list[torch.Tensor]) -> None:
        """The optimizer steps ``target`` from now on; its state (moments, step count) goes with it."""
        group = self.optimizer.param_groups[0]
        for old, new in zip(group["params"], target):
            if old in self.optimizer.state:
                self.optimizer.state[new] = self.optimizer.state.pop(old)
        group["params"] = list(target)

    def named(self, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        return {f"{i}.{name}": t.detach().clone() for (i, name), t in zip(self.names, tensors)}
