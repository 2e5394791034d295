"""Cost models: how long each op takes (integer nanoseconds) and how many bytes it moves and stashes.

Every model answers per stage with a ``StageCost``; the engine and the memory ledger read only that,
so uniform, analytic and profiled costs are interchangeable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

from pipescope.simulator.models import (
    ModelSpec,
    layer_work,
    output_activation_bytes,
    output_layer_flops,
    stage_layers,
)


@dataclass(frozen=True)
class StageCost:
    """What one stage costs for one microbatch.

    Attributes:
        forward_ns, input_grad_ns, weight_grad_ns: F, I and W durations (a fused B takes I + W).
        recompute_ns: the extra forward a backward runs first when recompute is on.
        boundary_bytes: bytes sent to the next stage (the gradient sent back has the same size).
        activation_bytes: M_B, what F stashes until the backward.
        weight_grad_bytes: M_W, what a deferred W still holds after I.
        input_bytes: the stage input, all that F keeps under recompute.
        params: parameters of the stage.
        optimizer_ns: the stage's optimizer step (AdamW with gradient norm and clipping), once per iteration after
            its last backward (0: not modelled, as in the closed forms).
    """

    forward_ns: int
    input_grad_ns: int
    weight_grad_ns: int
    recompute_ns: int = 0
    boundary_bytes: int = 0
    activation_bytes: int = 0
    weight_grad_bytes: int = 0
    input_bytes: int = 0
    params: int = 0
    optimizer_ns: int = 0


class CostModel(Protocol):
    """What the engine asks of a cost model."""

    precision: str

    def stage_cost(self, stage: int, num_stages: int, chunks: int) -> StageCost:
        """Costs of ``stage`` when the model is cut into ``num_stages`` stages, ``chunks`` per device."""
        ...

    def notes(self) -> list[str]:
        """Warnings for the result (extrapolation, precision mismatch); empty when there is nothing to say."""
        ...


MAX_OP_SECONDS = 1e6  # beyond 11 days per op a model size or efficiency is mistyped; ns would overflow int64 sums


class CostError(ValueError):
    """A cost model produced an op time no run could have (non-finite or beyond MAX_OP_SECONDS)."""


MAX_BYTES = 1 << 50  # 1 PiB: no stage of a real model stashes or sends more; keeps byte sums inside int64


def check_stage_costs(costs: list[StageCost]) -> None:
    """CostError unless every stage's times and bytes are non-negative and within MAX_OP_SECONDS and MAX_BYTES
    (whatever cost model made them: the engine and the ledger sum them in int64)."""
    for stage, cost in enumerate(costs):
        for name, value in vars(cost).items():
            limit = MAX_OP_SECONDS * 1e9 if name.endswith("_ns") else MAX_BYTES
            if not 0 <= value <= limit:
                raise CostError(f"stage {stage}: {name} would be {value:,}, expected 0 to {limit:,.0f}; check the "
                                f"model size and costs")


def seconds_to_ns(seconds: float) -> int:
    if not math.isfinite(seconds) or seconds > MAX_OP_SECONDS:
        raise CostError(f"an op would take {seconds:g} s (at most {MAX_OP_SECONDS:g} s); "
                        f"check the model size and costs.efficiency")
    ns = int(round(seconds * 1e9))
    return 1 if ns == 0 and seconds > 0 else ns  # a positive time never rounds to nothing: 1 ns is the resolution


class CostKind(StrEnum):
    """Which cost model a config asks for (``costs.kind``)."""

    ANALYTIC = "analytic"
    UNIFORM = "uniform"
    PROFILE = "profile"


def _time(default: float) -> float:
    """A config field in seconds that YAML and ``--set`` may write with units (``18.5ms``)."""
    return field(default=default, metadata={"unit": "time"})


@dataclass(frozen=True)
class UniformCostsConfig:
    """``costs.kind: uniform``: F, I, W per whole device-stage and a fixed p2p time per transfer (seconds)."""

    kind: CostKind = CostKind.UNIFORM
    forward: float = _time(1.0)
    backward_input: float = _time(1.0)
    backward_weight: float = _time(1.0)
    p2p: float = _time(0.0)

    def costs(self, precision: str) -> UniformCosts:
        return UniformCosts(self.forward, self.backward_input, self.backward_weight, precision=precision)


@dataclass(frozen=True)
class AnalyticCostsConfig:
    """``costs.kind: analytic``: FLOPs against the device's datasheet peak times ``efficiency``."""

    kind: CostKind = CostKind.ANALYTIC
    efficiency: float = 0.5


@dataclass(frozen=True)
class UniformCosts:
    """Fixed F, I and W times per whole device-stage (seconds), for theory and paper checks.

    A chunk op takes its share (1/v); a fused B takes I + W. Costs are per stage and do not depend on layers, so
    ``model.layers_per_stage`` changes nothing here. ``activation_bytes``/``weight_bytes`` optionally give
    memory a scale. The p2p time of uniform runs is the network's (``FifoLinks.fixed_delay``).
    """

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    activation_bytes: int = 0
    weight_grad_bytes: int = 0
    params: int = 0
    precision: str = "bf16"

    def stage_cost(self, stage: int, num_stages: int, chunks: int) -> StageCost:
        share = 1.0 / chunks
        return StageCost(
            forward_ns=seconds_to_ns(self.forward * share),
            input_grad_ns=seconds_to_ns(self.backward_input * share),
            weight_grad_ns=seconds_to_ns(self.backward_weight * share),
            recompute_ns=seconds_to_ns(self.forward * share),
            activation_bytes=int(self.activation_bytes * share),
            weight_grad_bytes=int(self.weight_grad_bytes * share),
            params=int(self.params * share),
        )

    def notes(self) -> list[str]:
        return []


class PerStageCache:
    """``stage_cost`` memoised per (stage, num_stages), for cost models whose ``_compute`` is costly.

    Chunks need no key: they are already counted in ``num_stages``. Subclasses declare a ``_cache`` dict field and
    a ``layers_per_stage`` field (None: the equal split).
    """

    _cache: dict
    layers_per_stage: tuple[int, ...] | None

    def stage_cost(self, stage: int, num_stages: int, chunks: int) -> StageCost:
        key = (stage, num_stages)
        if key not in self._cache:
            self._cache[key] = self._compute(stage, num_stages)
        return self._cache[key]

    def _compute(self, stage: int, num_stages: int) -> StageCost:
        raise NotImplementedError

    def _layers_of(self, stage: int, num_stages: int, layers: int) -> int:
        """Transformer blocks of ``stage`` (``models.stage_layers``), the split resolved once per stage count."""
        key = ("split", num_stages)
        if key not in self._cache:
            self._cache[key] = stage_layers(layers, num_stages, self.layers_per_stage)
        return self._cache[key][stage]


def split_layers(layers: int, num_stages: int) -> list[int]:
    """The equal split; kept for old callers, ``models.stage_layers`` is the one home of the layer split."""
    return stage_layers(layers, num_stages)


@dataclass(frozen=True)
class AnalyticCosts(PerStageCache):
    """FLOPs and bytes of each stage against a datasheet peak times an efficiency factor.

    The input embedding sits on the first stage and the output layer (logits, softmax,
    cross-entropy) on the last, as in a naive pipeline (no vocabulary parallelism). Each stage holds its share of
    transformer blocks (``layers_per_stage``, else the equal split; ``models.stage_layers``).
    """

    model: ModelSpec
    peak_flops: float  # the device's dense peak at ``precision`` (FLOP/s)
    microbatch_size: int = 1
    precision: str = "bf16"
    efficiency: float = 0.5
    layers_per_stage: tuple[int, ...] | None = None
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def _flops_ns(self, flops: float) -> int:
        rate = self.peak_flops * self.efficiency
        return seconds_to_ns(flops / rate)

    def _compute(self, stage: int, num_stages: int) -> StageCost:
        n = self._layers_of(stage, num_stages, self.model.layers)
        work = layer_work(self.model, self.microbatch_size, self.precision)
        f, i, w = n * work.forward_flops, n * work.input_grad_flops, n * work.weight_grad_flops
        params, stash = n * self.model.layer_params(), n * work.activation_bytes
        if stage == num_stages - 1:
            of, oi, ow = output_layer_flops(self.model, self.microbatch_size)
            f, i, w = f + of, i + oi, w + ow
            params += self.model.output_params()
            stash += output_activation_bytes(self.model, self.microbatch_size, self.precision)
        if stage == 0:
            params += self.model.embedding_params()
        return StageCost(
            forward_ns=self._flops_ns(f),
            input_grad_ns=self._flops_ns(i),
            weight_grad_ns=self._flops_ns(w),
            recompute_ns=self._flops_ns(f),
            boundary_bytes=work.boundary_bytes,
            activation_bytes=stash,
            weight_grad_bytes=n * work.weight_grad_bytes,
            input_bytes=work.boundary_bytes,
            params=params,
        )

    def notes(self) -> list[str]:
        return []

