"""Cost models: how long each op takes (integer nanoseconds) and how many bytes it moves and stashes.

Every model answers per stage with a ``StageCost``; the engine and the memory ledger read only that,
so uniform, analytic and profiled costs are interchangeable.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from pipescope.simulator.gpu_rates import FlashRates, Roofline, Tiling, bound_by, power_limited_clock
from pipescope.simulator.measured_gemms import MeasuredGemms
from pipescope.simulator.kernels import (
    PASSES,
    Kernel,
    attention_core_kernels,
    gradient_bytes,
    layer_kernels,
    optimizer_kernels,
    output_kernels,
)
from pipescope.simulator.models import PRECISIONS, ModelSpec, allocated_vocab, check_attention, stage_layers
from pipescope.simulator.offload import HostOffload
from pipescope.simulator.context import exposed_ns
from pipescope.simulator.parallel import TensorSplit
from pipescope.simulator.vocab import VocabShards

if TYPE_CHECKING:
    from pipescope.simulator.ir import Schedule


@dataclass(frozen=True)
class FsdpUnit:
    """One unit ZeRO-3 gathers at a time (a transformer block, the embedding, the output layer: as torchtitan wraps
    a model; docs/parallelism.md, "Units"): one GPU's parameters and its share of each pass of its stage."""

    params: int
    forward_ns: int
    input_grad_ns: int
    weight_grad_ns: int
    recompute_ns: int = 0

    def pass_ns(self, kind: str, recompute: bool) -> int:
        """Its share of an F, I or B op (a backward runs its recompute first)."""
        extra = self.recompute_ns if recompute else 0
        return {"F": self.forward_ns, "I": self.input_grad_ns + extra,
                "B": self.input_grad_ns + self.weight_grad_ns + extra}[kind]


@dataclass(frozen=True)
class StageCost:
    """What one stage costs for one microbatch.

    Attributes:
        forward_ns, input_grad_ns, weight_grad_ns: F, I and W durations.
        backward_ns: a fused B, where it was measured as one (a profile's B rows); None: I + W. On a CPU the two
            differ either way (docs/costs.md, "Fused and split backwards").
        recompute_ns: the extra forward a backward runs first when recompute is on.
        boundary_bytes: bytes sent to the next stage (the gradient sent back has the same size).
        activation_bytes: M_B, what F stashes until the backward.
        weight_grad_bytes: M_W, what a deferred W still holds after I.
        input_bytes: what F keeps under full recompute: the stage input (the first stage's: its token ids), or where
            the runtime checkpoints every block (Megatron), each block's input and the output layer's stash.
        rebuilt_bytes: what a backward rebuilds under full recompute before it runs; None: ``activation_bytes``
            (the whole stage's, re-run at once); Megatron's per-block checkpoints rebuild one block at a time.
        params: parameters of the stage.
        param_tensors: its parameter tensors (torch's AdamW keeps a 4-byte step counter per tensor).
        optimizer_ns: the stage's optimizer step (AdamW with gradient norm and clipping), once per iteration after
            its last backward, or after every backward under PipeDream (0: not modelled, as in the closed forms).
        vocab_s_ns, vocab_t_ns: the S and T passes over the vocabulary shard of the stage's device, per microbatch
            (vocabulary parallelism, ``simulator.vocab``; set on the device's first stage only, else 0).
        vocab_bytes: what the S pass stashes until the T pass (the shard's logits and softmax).
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
    param_tensors: int = 0
    vocab_s_ns: int = 0
    vocab_t_ns: int = 0
    vocab_bytes: int = 0
    backward_ns: int | None = None
    rebuilt_bytes: int | None = None
    units: tuple[FsdpUnit, ...] = ()  # FSDP's units of the stage in forward order (empty: the stage is one)

    @property
    def rebuilt(self) -> int:
        """What a backward rebuilds under full recompute (``rebuilt_bytes``, else the whole stage's M_B)."""
        return self.activation_bytes if self.rebuilt_bytes is None else self.rebuilt_bytes


class CostModel(Protocol):
    """What the engine asks of a cost model."""

    precision: str

    def stage_cost(self, stage: int, num_stages: int, chunks: int) -> StageCost:
        """Costs of ``stage`` when the model is cut into ``num_stages`` stages, ``chunks`` per device."""
        ...

    def notes(self) -> list[str]:
        """Warnings for the result (extrapolation, precision mismatch); empty when there is nothing to say."""
        ...

    def kernel_report(self, num_stages: int) -> list[dict]:
        """``simulate --json``'s ``kernels``: what each stage's passes are made of, where the model knows (the
        analytic roofline); empty otherwise."""
        ...


MAX_OP_SECONDS = 1e6  # beyond 11 days per op a model size or efficiency is mistyped; ns would overflow int64 sums


class CostError(ValueError):
    """A cost model produced an op time no run could have (non-finite or beyond MAX_OP_SECONDS)."""


MAX_BYTES = 1 << 50  # 1 PiB: no stage of a real model stashes or sends more; keeps byte sums inside int64


def stage_costs(costs: CostModel, schedule: Schedule) -> list[StageCost]:
    """Every stage's costs in ``schedule``, in stage order: each its model stage's (``Schedule.model_stage``) of
    one pipeline's stages, ``pipeline_stages / p`` of them per device (DualPipe's two copies cost the same)."""
    length = schedule.pipeline_stages
    chunks = max(1, length // max(1, schedule.num_devices))
    return [costs.stage_cost(schedule.model_stage(s), length, chunks) for s in range(schedule.num_stages)]


def check_stage_costs(costs: list[StageCost]) -> None:
    """CostError unless every stage's times and bytes are non-negative and within MAX_OP_SECONDS and MAX_BYTES
    (whatever cost model made them: the engine and the ledger sum them in int64)."""
    for stage, cost in enumerate(costs):
        for name, value in vars(cost).items():
            if name == "units":  # parts of the stage's own numbers, checked with them
                continue
            limit = MAX_OP_SECONDS * 1e9 if name.endswith("_ns") else MAX_BYTES
            if value is not None and not 0 <= value <= limit:  # None: an unmeasured fused B (I + W)
                raise CostError(f"stage {stage}: {name} would be {value:,}, expected 0 to {limit:,.0f}; check the "
                                f"model size and costs")


def seconds_to_ns(seconds: float) -> int:
    if not math.isfinite(seconds) or seconds > MAX_OP_SECONDS:
        raise CostError(f"an op would take {seconds:g} s (at most {MAX_OP_SECONDS:g} s); "
                        f"check the model size and the rate keys costs.efficiency, costs.memory_efficiency, "
                        f"costs.eager_efficiency and costs.sustained")
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
    optimizer: float = _time(0.0)  # 0: no optimizer step, so the closed forms of docs/schedules.md hold
    vocab_s: float = _time(0.0)  # a device's S pass under vocab-1/vocab-2/interlaced (0: the closed forms hold)
    vocab_t: float = _time(0.0)  # a device's T pass

    def costs(self, precision: str) -> UniformCosts:
        return UniformCosts(self.forward, self.backward_input, self.backward_weight, precision=precision,
                            optimizer=self.optimizer, vocab_s=self.vocab_s, vocab_t=self.vocab_t)


# Without a GPU's measurement (an AnalyticCosts built in Python): a streaming kernel at 0.8 of the bandwidth, a
# choice between the large copies that get close to the datasheet and a layer's short kernels (docs/costs.md).
DEFAULT_MEMORY_EFFICIENCY = 0.8


@dataclass(frozen=True)
class AnalyticCostsConfig:
    """``costs.kind: analytic``: a roofline per kernel; matmuls at ``efficiency`` of the datasheet peak FLOP/s (less
    their tile and wave quantization), memory traffic at ``memory_efficiency`` of its bandwidth, compute at
    ``sustained`` of those rates under continuous load; unset, each is what the GPU was measured to reach
    (``topologies/devices.py``; docs/costs.md, "Rates"). ``gemms``: a
    ``pipescope calibrate-gemms`` folder whose measured matmul rates replace the large-GEMM rate ("Measured
    GEMMs")."""

    kind: CostKind = CostKind.ANALYTIC
    efficiency: float | None = None
    memory_efficiency: float | None = None
    eager_efficiency: float | None = None
    sustained: float | None = None
    gemms: str | None = None


TOKEN_ID_BYTES = 8  # the first stage's input: int64 token ids, not an activation
NORM_STATS_BYTES = 8  # a layer norm keeps each token's mean and reciprocal deviation in fp32 for its backward


@dataclass(frozen=True)
class UniformCosts:
    """Fixed F, I and W times per whole device-stage (seconds), for theory and paper checks.

    A chunk op takes its share (1/v), and so does its optimizer step; a fused B takes I + W. Costs are per stage
    and do not depend on layers, so ``model.layers_per_stage`` changes nothing here.
    ``activation_bytes``/``weight_bytes`` optionally give memory a scale. The p2p time of uniform runs is the
    network's (``FifoLinks.fixed_delay``).
    """

    forward: float = 1.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    activation_bytes: int = 0
    weight_grad_bytes: int = 0
    params: int = 0
    precision: str = "bf16"
    optimizer: float = 0.0  # the optimizer step per whole device-stage (0: none, as in the closed forms)
    vocab_s: float = 0.0  # a device's S and T passes (vocabulary parallelism; run only where a schedule has them)
    vocab_t: float = 0.0

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
            optimizer_ns=seconds_to_ns(self.optimizer * share),
            vocab_s_ns=seconds_to_ns(self.vocab_s),
            vocab_t_ns=seconds_to_ns(self.vocab_t),
        )

    def notes(self) -> list[str]:
        return []

    def kernel_report(self, num_stages: int) -> list[dict]:
        return []  # uniform op times are no kernels


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
    """Each stage's passes as kernels (``kernels.layer_kernels``, ``output_kernels``, ``optimizer_kernels``), each
    timed by a roofline (``gpu_rates.Roofline``): matmuls at ``efficiency`` of the datasheet peak FLOP/s less what
    ``tiling`` wastes, flash attention at ``flash`` rates, memory traffic at ``memory_efficiency`` of the datasheet
    bandwidth (docs/costs.md). Without ``tiling`` or ``flash`` (an AnalyticCosts built in Python) every FLOP runs at
    ``efficiency`` of the peak.

    The input embedding sits on the first stage and the output layer (logits, softmax,
    cross-entropy) on the last, as in a naive pipeline (no vocabulary parallelism). Each stage holds its share of
    transformer blocks (``layers_per_stage``, else the equal split; ``models.stage_layers``). Without a
    ``memory_bandwidth`` memory traffic is not timed: all FLOPs at ``efficiency`` of the peak and no optimizer step,
    the model before the roofline. Activation bytes follow ``attention`` (``models.layer_work``). ``split`` is
    tensor parallelism and selective recompute (``simulator.parallel``): every number is one GPU's, and F and I
    add the stage's tensor-parallel collectives (docs/costs.md, "Tensor parallelism").
    """

    model: ModelSpec
    peak_flops: float  # the device's dense peak at ``precision`` (FLOP/s)
    microbatch_size: int = 1
    precision: str = "bf16"
    efficiency: float = 0.5
    layers_per_stage: tuple[int, ...] | None = None
    memory_bandwidth: float | None = None  # the device's datasheet bytes/s; None: memory traffic not timed
    memory_efficiency: float = DEFAULT_MEMORY_EFFICIENCY
    eager_efficiency: float | None = None  # eager attention's score kernels' share of the bandwidth (None: streaming)
    attention: str = "flash"
    split: TensorSplit = TensorSplit()
    vocab: VocabShards | None = None  # None: naive placement; else vocabulary parallelism (simulator/vocab.py)
    tiling: Tiling | None = None  # the GPU's SMs, for a GEMM's tile and wave quantization
    flash: FlashRates | None = None  # the GPU's measured flash-attention rates
    gemms: MeasuredGemms | None = None  # measured matmul rates in place of ``efficiency`` (calibrate-gemms)
    misaligned_gemm: tuple[tuple[str, float], ...] = ()  # per pass, a misaligned matmul's fraction of the rate
    sustained: float = 1.0  # the compute rates' fraction held under continuous load (gpu_rates.Roofline)
    power_headroom: float | None = None  # FLOP/s at which the GPU reaches its power limit; sets ``sustained`` per stage
    vocab_runtime: str = "torch"  # whose vocabulary padding the logits run with (models.allocated_vocab)
    warnings: tuple[str, ...] = ()  # about the inputs (a GEMM table from another device), for the result
    grad_bytes: int | None = None  # per gradient, as the runtime keeps them (None: the precision's)
    checkpoint_layers: bool = False  # full recompute keeps each block's input and rebuilds one block at a time
    optimizer_shards: int = 1  # a distributed optimizer steps 1 / shards of the stage's parameters
    offload: HostOffload | None = None  # the step on the host (ZeRO-Offload), else on the GPU
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        check_attention(self.attention)

    @property
    def roofline(self) -> Roofline:
        """The rates at the fixed ``sustained`` fraction (at the boost clock where a power headroom is given)."""
        memory = self.memory_bandwidth * self.memory_efficiency if self.memory_bandwidth else None
        sustained = 1.0 if self.power_headroom else self.sustained
        scores = self.memory_bandwidth * self.eager_efficiency if memory and self.eager_efficiency else None
        return Roofline(self.peak_flops, self.efficiency, memory, self.tiling, self.flash, self.gemms,
                        self.misaligned_gemm, sustained, scores)

    def rates(self, stage: int, num_stages: int) -> Roofline:
        """The rates the stage's GPU runs at: with a power headroom, the compute rates at the clock its F, I and W
        mix holds at the GPU's power limit (``gpu_rates.power_limited_clock``); else ``roofline``."""
        boost = self.roofline
        if not self.power_headroom:
            return boost
        key = ("clock", stage, num_stages)
        if key not in self._cache:
            flops = compute = memory = 0.0
            for _, count, kernels, rates in self._parts(stage, num_stages, boost):
                for kernel in (k for k in kernels if k.op != "optimizer" and rates is boost):
                    compute_s, memory_s = boost.times(kernel)  # once: ``bound`` would time it again
                    flops += count * boost.work(kernel)
                    if bound_by(kernel, compute_s, memory_s) == "compute":
                        compute += count * compute_s
                    else:
                        memory += count * memory_s
            self._cache[key] = replace(boost, sustained=power_limited_clock(flops, compute, memory,
                                                                            self.power_headroom))
        return self._cache[key]

    def _compute(self, stage: int, num_stages: int) -> StageCost:
        n = self._layers_of(stage, num_stages, self.model.layers)
        work = self.split.layer_work(self.model, self.microbatch_size, self.precision, self.attention)
        seconds, layers_forward = dict.fromkeys(PASSES, 0.0), 0.0
        edges: dict[str, dict[str, float]] = {}  # the embedding's and the output layer's passes, for their units
        gpu = self.rates(stage, num_stages)
        for component, count, kernels, roofline in self._parts(stage, num_stages, gpu):
            passes = roofline.pass_seconds(kernels)
            for op, value in passes.items():
                seconds[op] += count * value
            if component == "layer":
                layers_forward = count * passes["F"]
            elif component in ("embedding", "output"):
                edges[component] = passes
        stash = n * work.activation_bytes
        output = self.split.output_bytes(self.model, self.microbatch_size, self.precision) \
            if stage == num_stages - 1 and self.vocab is None else 0
        stash += output
        block_input = self.split.stage_input_bytes(self.model, self.microbatch_size, self.precision)
        kept = (n * block_input + output) if self.checkpoint_layers else block_input if stage \
            else self.microbatch_size * self.model.seq * TOKEN_ID_BYTES // self.split.context  # its token ids
        if stage == 0 and self.model.embedding_norm:  # no block: kept for its backward whatever is recomputed
            norm = self._embedding_norm_bytes(block_input)
            stash, kept = stash + norm, kept + norm
        gemm_ns = self._layer_gemm_ns(gpu)
        comm_f, comm_i = self.split.comm_ns(stage, n, stage == 0, stage == num_stages - 1, gemm_ns)
        context_f, context_i = self._context_ns(stage, n, gpu)
        vocab = self._vocab_passes(stage, gpu)
        totals = (seconds_to_ns(seconds["F"]) + comm_f + context_f, seconds_to_ns(seconds["I"]) + comm_i + context_i,
                  seconds_to_ns(seconds["W"]),
                  # full recompute re-runs the blocks' forwards with their collectives, not the output layer
                  # (Megatron checkpoints the transformer blocks only)
                  seconds_to_ns(layers_forward) + self.split.comm_ns(stage, n, False, False, gemm_ns)[0] + context_f)
        return StageCost(
            forward_ns=totals[0],
            input_grad_ns=totals[1],
            weight_grad_ns=totals[2],
            recompute_ns=totals[3],
            boundary_bytes=work.boundary_bytes,
            activation_bytes=stash,
            weight_grad_bytes=n * work.weight_grad_bytes,
            input_bytes=kept,
            rebuilt_bytes=work.activation_bytes if self.checkpoint_layers else None,
            params=self._params(stage, num_stages, n),
            optimizer_ns=seconds_to_ns(seconds["optimizer"]) + self._context_grad_ns(stage),
            units=self._units(stage, num_stages, n, totals, edges),
            **vocab,
        )

    def _units(self, stage: int, num_stages: int, blocks: int, totals: tuple[int, int, int, int],
               edges: dict[str, dict[str, float]]) -> tuple[FsdpUnit, ...]:
        """The stage's FSDP units in forward order: the embedding's on the first stage (its parameters beside the
        blocks', with its layer norm's passes), one per block (the passes' rest, shared equally; the last takes what
        rounding leaves), the output layer's on the last (its kernels' passes; on a stage that is also the first,
        its parameters are the embedding unit's, gathered first). None under vocabulary parallelism, whose shards
        run passes of their own."""
        if self.vocab is not None or blocks < 1:
            return ()
        first, last = stage == 0, stage == num_stages - 1
        block = self.split.params(self.model, 1, False, False)
        edge_params = self.split.params(self.model, blocks, first, last) - blocks * block
        front = self._edge_unit(edges.get("embedding"), edge_params if first else 0) if first else None
        back = self._edge_unit(edges.get("output"), 0 if first else edge_params) if last else None
        rest = [total - sum(self._unit_times(u)[k] for u in (front, back) if u is not None)
                for k, total in enumerate(totals)]
        share = [max(0, r) // blocks for r in rest]
        blocks_ = [FsdpUnit(block, *share)] * (blocks - 1)
        blocks_.append(FsdpUnit(block, *(max(0, r) - (blocks - 1) * s for r, s in zip(rest, share))))
        return tuple(u for u in (front, *blocks_, back) if u is not None)

    @staticmethod
    def _edge_unit(passes: dict[str, float] | None, params: int) -> FsdpUnit:
        """The embedding's or the output layer's unit: its parameters and its kernels' passes (none: 0)."""
        passes = passes or {}
        return FsdpUnit(params, *(seconds_to_ns(passes.get(op, 0.0)) for op in ("F", "I", "W")))

    @staticmethod
    def _unit_times(unit: FsdpUnit) -> tuple[int, int, int, int]:
        return unit.forward_ns, unit.input_grad_ns, unit.weight_grad_ns, unit.recompute_ns

    def _embedding_norm_bytes(self, norm_input: int) -> int:
        """What the embedding's layer norm keeps for its backward: its input and two fp32 numbers a token."""
        tokens = norm_input // (self.model.hidden * PRECISIONS[self.precision].activation_bytes)
        return norm_input + NORM_STATS_BYTES * tokens

    def _context_ns(self, stage: int, layers: int, gpu: Roofline) -> tuple[int, int]:
        """(ns added to F, to I) for the stage's context-parallel key/value exchange (``context.exposed_ns``)."""
        s = self.split
        if s.context < 2 or not s.context_times:
            return 0, 0
        kernels = layer_kernels(self.model, self.microbatch_size, self.precision, self.attention, s.tensor,
                                s.sequence, s.context)
        attention = {k.op: seconds_to_ns(gpu.seconds(k)) for k in kernels if k.flash is not None}
        return exposed_ns(s.context_times[stage], s.context, s.context_comm, layers,
                          (attention.get("F", 0), attention.get("I", 0)))

    def _context_grad_ns(self, stage: int) -> int:
        """The all-reduce of the stage's gradients over its context group, before its step (``simulator/context``)."""
        s = self.split
        return s.context_times[stage].grad_all_reduce if s.context > 1 and s.context_times else 0

    def _layer_gemm_ns(self, gpu: Roofline) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """One block's matmul times in F and I, in the order its tensor-parallel collectives pair with them
        (``TensorSplit.comm_ns``): QKV, out projection, MLP up, MLP down in F; MLP down, MLP up, out projection, QKV
        in I (the backward runs the block in reverse)."""
        if not self.split.overlap:
            return (), ()
        kernels = layer_kernels(self.model, self.microbatch_size, self.precision, self.attention, self.split.tensor,
                                self.split.sequence, self.split.context)
        ns = {(k.op, k.name): seconds_to_ns(gpu.seconds(k)) for k in kernels if k.gemm is not None}
        forward = ("QKV", "out projection", "MLP up", "MLP down")
        return tuple(ns["F", name] for name in forward), tuple(ns["I", name] for name in reversed(forward))

    def _vocab_passes(self, stage: int, gpu: Roofline) -> dict[str, int]:
        """The S and T pass times and stash of the stage's vocabulary shard (empty under the naive placement)."""
        if self.vocab is None or not self.vocab.owns(stage):
            return {}
        passes = {op: sum(map(gpu.seconds, kernels)) for op, kernels in self.vocab.pass_kernels().items()}
        return {"vocab_s_ns": seconds_to_ns(passes["S"]), "vocab_t_ns": seconds_to_ns(passes["T"]),
                "vocab_bytes": self.vocab.stash_bytes()}

    def _params(self, stage: int, num_stages: int, layers: int) -> int:
        """Parameters of the stage (one GPU's under tensor parallelism): its blocks, the embedding on the first, the
        output projection on the last (under vocabulary parallelism: its device's shard of both,
        ``VocabShards.params``; the runner refuses tensor parallelism with it)."""
        if self.vocab is not None:
            return layers * self.model.layer_params() + self.vocab.params(stage)
        return self.split.params(self.model, layers, stage == 0, stage == num_stages - 1)

    def _parts(self, stage: int, num_stages: int, gpu: Roofline) -> list[tuple[str, int, list[Kernel], Roofline]]:
        """(component, instances, kernels of one instance, the rates that time them) of the stage: its blocks, the
        output layer on the last stage, and one optimizer step over its parameters (without a memory bandwidth:
        none), on the host when offloaded; ``gpu`` times what runs on the GPU (the kernels are built once per
        stage: the clock's solve and the stage's times both read them)."""
        key = ("parts", stage, num_stages)
        if key not in self._cache:
            self._cache[key] = self._kernel_parts(stage, num_stages)
        return [(component, count, kernels, gpu if rates is None else rates)
                for component, count, kernels, rates in self._cache[key]]

    def _kernel_parts(self, stage: int, num_stages: int) -> list[tuple[str, int, list[Kernel], Roofline | None]]:
        """``_parts`` with None for the GPU's rates."""
        gpu = None
        n, t, sp = self._layers_of(stage, num_stages, self.model.layers), self.split.tensor, self.split.sequence
        cp, b = self.split.context, self.microbatch_size
        parts = [("layer", n, layer_kernels(self.model, b, self.precision, self.attention, t, sp, cp), gpu)]
        if stage == 0 and self.model.embedding_norm:  # reads and writes the embedding's output; its backward reads two
            x = self.split.stage_input_bytes(self.model, b, self.precision)
            parts.append(("embedding", 1, [Kernel("embedding layer norm", "F", 0, 2 * x),
                                           Kernel("embedding layer norm", "I", 0, 3 * x)], gpu))
        if self.split.selective:  # the backward re-runs the attention core's forward first
            core = attention_core_kernels(self.model, b, self.precision, self.attention, t, cp)
            parts.append(("recompute", n, [replace(k, op="I") for k in core], gpu))
        if stage == num_stages - 1 and self.vocab is None:
            allocated = allocated_vocab(self.vocab_runtime, self.model.vocab, t)
            parts.append(("output", 1, output_kernels(self.model, b, self.precision, t, sp, cp, allocated), gpu))
        params = -(-self._params(stage, num_stages, n) // self.optimizer_shards)
        if self.offload is not None:
            grads = gradient_bytes(self.precision, self.grad_bytes)
            parts += [(component, 1, kernels, rates)
                      for component, kernels, rates in self.offload.step_parts(params, self.precision, grads)]
        elif self.memory_bandwidth:
            parts.append(("optimizer", 1, optimizer_kernels(params, self.precision, self.grad_bytes), gpu))
        return parts

    def stage_kernels(self, stage: int, num_stages: int) -> list[dict]:
        """The stage's kernels for one microbatch (the optimizer's per iteration): component, kernel, pass,
        instances, and FLOPs, bytes and seconds over all instances, with the roofline term that set the time."""
        rows, gpu = [], self.rates(stage, num_stages)
        parts = [(component, count, kernels, None, rates)
                 for component, count, kernels, rates in self._parts(stage, num_stages, gpu)]
        if self.vocab is not None and self.vocab.owns(stage):  # the device's S and T passes, under their own names
            parts += [("vocab shard", 1, kernels, op, gpu)
                      for op, kernels in self.vocab.pass_kernels().items()]
        for component, count, kernels, op, rates in parts:
            rows += [_kernel_row(component, count, k, op, rates) for k in kernels]
        return rows

    def kernel_report(self, num_stages: int) -> list[dict]:
        """``simulate --json``'s ``kernels``: one entry per group of stages with the same kernels (same layer count,
        first or last or neither, with a vocabulary shard or not), so a long pipeline of equal stages lists its
        kernels once."""
        groups: dict[tuple, dict] = {}
        for stage in range(num_stages):
            n = self._layers_of(stage, num_stages, self.model.layers)
            key = (n, stage == 0, stage == num_stages - 1, self.vocab is not None and self.vocab.owns(stage))
            if key not in groups:
                rows = self.stage_kernels(stage, num_stages)
                totals = dict.fromkeys(PASSES, 0.0)
                for row in rows:
                    totals[row["pass"]] = totals.get(row["pass"], 0.0) + row["time_s"]
                groups[key] = {"stages": [], "layers": n, "pass_time_s": totals,
                               "sustained": self.rates(stage, num_stages).sustained, "kernels": rows}
            groups[key]["stages"].append(stage)
        return list(groups.values())

    def notes(self) -> list[str]:
        return list(self.warnings)


def _kernel_row(component: str, count: int, kernel: Kernel, op: str | None, roofline: Roofline) -> dict:
    """One row of ``kernels``: a matmul also says its shape ([batch, rows, cols, inner]) and every kernel with FLOPs
    its efficiency (model FLOPs per second over the peak)."""
    row = {"component": component, "kernel": kernel.name, "pass": op or kernel.op, "count": count,
           "flops": float(count * kernel.flops), "bytes": int(count * kernel.nbytes),
           "time_s": count * roofline.seconds(kernel), "bound": roofline.bound(kernel),
           "efficiency": roofline.efficiency(kernel)}
    if kernel.gemm is not None:
        g = kernel.gemm
        row["shape"] = [g.batch, g.rows, g.cols, g.inner]
    return row
