"""Tensor parallelism (Megatron-style) and the recompute modes: the ``parallel`` config section, what one of a
stage's t GPUs holds and sends, and the time of its tensor-parallel collectives.

A simulated device is a pipeline device: with ``parallel.tensor`` t > 1 it stands for t GPUs of one node that split
each layer's matmuls (column-parallel QKV and MLP up, row-parallel out projection and MLP down) and the vocabulary
layers. The analytic kernels divide by t where Megatron splits (``kernels.layer_kernels``); this module gives the
per-GPU bytes (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models"; docs/memory.md,
"Tensor parallelism") and the collectives each op runs, priced on the idle network of the stage's GPU group and
added to the op's time (docs/network.md, "Tensor parallelism").
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pipescope.simulator.context import ContextTimes
from pipescope.simulator.mesh import DeviceMesh, Sharding
from pipescope.simulator.models import (
    PRECISIONS,
    LayerWork,
    ModelSpec,
    layer_work,
    output_activation_bytes,
    stash_widths,
)
from pipescope.simulator.readers.units import short_repr

if TYPE_CHECKING:
    from pipescope.simulator.routed import IdleTimes

RECOMPUTE_MODES = ("none", "selective", "full")  # schedule.recompute; docs/cli.md
# The old boolean key, in the config's boolean spellings (pipescope/config.py): true means full, false none.
_RECOMPUTE_BOOLS = {**dict.fromkeys(("true", "yes", "1", "on"), "full"),
                    **dict.fromkeys(("false", "no", "0", "off"), "none")}


def parse_recompute(value: object) -> str:
    """``schedule.recompute`` as one of ``RECOMPUTE_MODES``; the old boolean's values are ``full``/``none``.

    Raises:
        ValueError: anything else (the caller names the key).
    """
    text = str(value).strip().lower() if isinstance(value, (bool, int, str)) else None
    if text in _RECOMPUTE_BOOLS:
        return _RECOMPUTE_BOOLS[text]
    if text not in RECOMPUTE_MODES:
        raise ValueError(f"got {short_repr(value)}, expected one of {', '.join(RECOMPUTE_MODES)} (or true/false for "
                         f"full/none)")
    return text


@dataclass(frozen=True)
class ParallelConfig:
    """The ``parallel`` section: ``tensor`` GPUs of one node per pipeline device (Megatron tensor parallelism, 1:
    none) and ``sequence`` parallelism over them (reduce-scatter and all-gather in place of the all-reduces, the layer
    norms and dropouts split over t; needs tensor > 1); ``tp_comm_overlap``: those all-gathers and reduce-scatters
    run in chunks behind the matmuls they feed or follow (Transformer Engine's userbuffers; needs sequence);
    ``zero``: the ZeRO stage over the data-parallel replicas (0 none; 1 optimizer state, 2 and gradients, 3 and
    weights: ``mesh.Sharding``), ``reshard_after_forward`` and ``zero_prefetch`` its stage 3's choices;
    ``shard_group``: HSDP's shard group, in replicas; ``context`` and ``context_comm``: context parallelism
    (``simulator/context.py``); ``offload``: ``optimizer`` keeps the optimizer state on the host and steps it
    there, ``parameters`` the ZeRO-3 weight shards too (``simulator/offload.py``); ``distributed_optimizer``: the
    older spelling of ``zero: 1`` (Megatron's distributed optimizer), kept working.
    docs/parallelism.md, docs/cli.md."""

    tensor: int = 1
    sequence: bool = False
    tp_comm_overlap: bool = False
    distributed_optimizer: bool = False
    zero: int = 0
    reshard_after_forward: bool = True
    zero_prefetch: int = 1  # ZeRO-3: ops ahead a weight gather is issued (FSDP's prefetch of the next unit: 1)
    shard_group: int | None = None  # HSDP: replicas one set of ZeRO shards spans; None: all of them
    context: int = 1  # context parallelism: GPUs of a tensor rank that split the sequence (simulator/context.py)
    context_comm: str = "p2p"  # how they exchange keys and values: p2p (ring) or all_gather
    offload: str = "none"  # optimizer: its state and step on the host (ZeRO-Offload); parameters: and the weights

    @property
    def gpus_per_device(self) -> int:
        """The GPUs one simulated device stands for: tensor x context."""
        return self.tensor * self.context

    @property
    def offloads_optimizer(self) -> bool:
        return self.offload in ("optimizer", "parameters")

    @property
    def offloads_parameters(self) -> bool:
        return self.offload == "parameters"

    @property
    def zero_stage(self) -> int:
        """The ZeRO stage that runs: ``zero``, or 1 under ``distributed_optimizer``."""
        return max(self.zero, 1 if self.distributed_optimizer else 0)

    def reduce_group(self, data_parallel: int) -> int:
        """The replicas a gradient reduction first spans: all of them, or under HSDP a shard group."""
        return (self.shard_group or data_parallel) if self.zero_stage else data_parallel

    def optimizer_shards(self, data_parallel: int) -> int:
        """How many shards each GPU's optimizer state and step are cut into: the replicas of a shard group under
        ZeRO (all of them, or ``shard_group`` under HSDP), else 1."""
        return self.reduce_group(data_parallel) if self.zero_stage else 1

    def sharding(self, data_parallel: int) -> Sharding:
        """ZeRO's states and shards over ``data_parallel`` replicas (the memory ledger and the planner read it)."""
        return Sharding(self.zero_stage, self.optimizer_shards(data_parallel), self.reshard_after_forward,
                        prefetch=self.zero_prefetch, offload=self.offloads_optimizer,
                        offload_params=self.offloads_parameters)


# Inclusive (low, high) of each integer key of the parallel section (docs/cli.md, "Limits"): the config's RANGES
# takes them from here, beside the section they bound.
PARALLEL_RANGES: dict[str, tuple[int, int]] = {"tensor": (1, 1024), "zero": (0, 3), "zero_prefetch": (1, 64),
                                               "shard_group": (1, 100_000), "context": (1, 1024)}


def check_parallel(parallel: ParallelConfig, model: ModelSpec | None, gpus_per_node: int | None) -> None:
    """ValueError naming the key unless t divides the node's GPUs, the heads (so the hidden and MLP sizes) and, with
    sequence parallelism, the sequence; and sequence parallelism has t > 1. ``None``: that part is not checked."""
    t = parallel.tensor
    if parallel.tp_comm_overlap and not parallel.sequence:
        raise ValueError("parallel.tp_comm_overlap: got true without parallel.sequence, expected parallel.sequence "
                         "true (the overlap splits sequence parallelism's all-gathers and reduce-scatters)")
    if parallel.sequence and t < 2:
        raise ValueError("parallel.sequence: got true with parallel.tensor = 1, expected parallel.tensor > 1 "
                         "(sequence parallelism splits over the tensor-parallel GPUs)")
    if gpus_per_node is not None and gpus_per_node % t:
        raise ValueError(f"parallel.tensor: got {t}, expected a divisor of the {gpus_per_node} GPUs per node "
                         f"(a stage's tensor-parallel GPUs share one node)")
    if model is None:
        return
    if model.heads % t:
        raise ValueError(f"parallel.tensor: got {t}, expected a divisor of model.heads (={model.heads}), so each GPU "
                         f"holds whole heads")
    if model.hidden % t:
        raise ValueError(f"parallel.tensor: got {t}, expected a divisor of model.hidden (={model.hidden})")
    if model.kv_heads is not None and model.kv_heads % t:
        raise ValueError(f"parallel.tensor: got {t}, expected a divisor of model.kv_heads (={model.kv_heads}), so each "
                         f"GPU holds whole key/value groups")
    if model.ffn % t:
        raise ValueError(f"parallel.tensor: got {t}, expected a divisor of the MLP width (={model.ffn})")
    local = model.seq // parallel.context  # a context rank's tokens, which sequence parallelism splits further
    if parallel.sequence and (model.seq % parallel.context or local % t):
        where = f"model.seq (={model.seq})" if parallel.context == 1 else \
            f"a context rank's tokens, model.seq / parallel.context (={model.seq} / {parallel.context})"
        raise ValueError(f"parallel.tensor: got {t} with parallel.sequence, expected a divisor of {where}, which "
                         f"sequence parallelism splits")


@dataclass(frozen=True)
class CollectiveTimes:
    """ns of the tensor-parallel collectives of one stage's GPU group on the idle network: all-reduce, all-gather
    and reduce-scatter of one activation (s x b x h elements), and the all-reduce of cross-entropy's fp32 per-token
    statistics (max, sum of exponentials, target logit: three of these per microbatch)."""

    all_reduce: int = 0
    all_gather: int = 0
    reduce_scatter: int = 0
    token_all_reduce: int = 0


@dataclass(frozen=True)
class TensorSplit:
    """What one of a stage's ``tensor`` (x ``context``) GPUs computes, holds and waits for; the defaults are no split
    at all.

    Attributes:
        tensor: t, the tensor-parallel width.
        sequence: sequence parallelism over the t GPUs.
        selective: selective recompute (the attention core is not stashed; the backward re-runs it).
        times: per stage, the idle-network time of its group's collectives (empty: free, as at t = 1).
    """

    tensor: int = 1
    sequence: bool = False
    selective: bool = False
    times: tuple[CollectiveTimes, ...] = ()
    overlap: bool = False  # parallel.tp_comm_overlap: each layer collective runs behind its matmul
    context: int = 1  # parallel.context: each of the device's GPUs holds 1/context of the tokens
    context_comm: str = "p2p"
    context_times: tuple[ContextTimes, ...] = ()  # per stage (empty: free, as at context 1)

    def layer_work(self, model: ModelSpec, microbatch_size: int, precision: str, attention: str) -> LayerWork:
        """``models.layer_work`` with per-GPU bytes (FLOPs stay the whole layer's: the MFU convention's).

        ``M_B`` per layer (bf16, Korthikanti's Table 2 and its flash analogue, docs/memory.md; GPT's widths,
        ``models.stash_widths`` has Llama's): eager ``sbh(10 + 24/t) + 5as^2b/t``, flash ``sbh(10 + 24/t) + 4abs/t``;
        with sequence parallelism the ``10sbh`` kept whole is split too (``34sbh/t``); selective recompute drops the
        attention core's term. ``M_W`` is ``8sbh + 24sbh/t`` (``32sbh/t`` with sequence parallelism). The boundary is
        one GPU's slice, ``sbh/t``: Megatron sends a stage's output as t slices in parallel, one per GPU.
        """
        whole = layer_work(model, microbatch_size, precision, attention)
        t, w = self.tensor, stash_widths(model)
        s, a = model.seq, model.heads
        tokens = s * microbatch_size // self.context  # context parallelism: this GPU's share of the sequence
        scale = PRECISIONS[precision].activation_bytes / 2  # the paper's counts are for 2-byte activations
        kept_whole, split = (0, (w.whole + w.split) // t) if self.sequence else (w.whole, w.split // t)
        stash = int(tokens * (kept_whole + split) * scale)
        if not self.selective:
            stash += (int(tokens * w.scores * (a // t) * s * scale) if attention == "eager"
                      else 4 * (a // t) * tokens)  # flash's fp32 log-sum-exp per row and head
        w_whole, w_split = (0, (w.weight_whole + w.weight_split) // t) if self.sequence \
            else (w.weight_whole, w.weight_split // t)
        return replace(whole, activation_bytes=stash, weight_grad_bytes=int(tokens * (w_whole + w_split) * scale),
                       boundary_bytes=whole.boundary_bytes // t // self.context)

    def stage_input_bytes(self, model: ModelSpec, microbatch_size: int, precision: str) -> int:
        """The stage input, all ``F`` keeps under full recompute: whole on every GPU, or its 1/t sequence slice (of
        its 1/cp share under context parallelism)."""
        nbytes = model.seq * microbatch_size * model.hidden * PRECISIONS[precision].activation_bytes // self.context
        return nbytes // self.tensor if self.sequence else nbytes

    def output_bytes(self, model: ModelSpec, microbatch_size: int, precision: str) -> int:
        """The output layer's stash on one GPU: its vocabulary slice of the logits plus their fp32 softmax, for its
        share of the tokens."""
        whole = output_activation_bytes(replace(model, vocab=self.vocab_slice(model)), microbatch_size, precision)
        return whole // self.context

    def vocab_slice(self, model: ModelSpec) -> int:
        """Vocabulary rows per GPU: ceil(V / t) (Megatron pads the vocabulary to a multiple of t)."""
        return -(-model.vocab // self.tensor)

    def params(self, model: ModelSpec, layers: int, first: bool, last: bool) -> int:
        """Parameters on one GPU: the split matmuls' weights and the column-parallel ones' biases over t; the row-
        parallel biases and the norms whole; the token embedding and output projection by vocabulary slice, the
        position embedding (GPT's), an embedding layer norm and Llama's final norm whole."""
        t, h = self.tensor, model.hidden
        if t == 1:
            params = layers * model.layer_params()
        else:
            whole = 2 * h if model.family == "llama" else 6 * h  # GPT: two biases and two layer norms
            column_biases = 0 if model.family == "llama" else h + 2 * model.kv_width + model.ffn
            params = layers * (model.matmul_params() // t + column_biases // t + whole)
        if last:
            params += self.vocab_slice(model) * h + model.output_params() - model.vocab * h
        if first:
            params += self.vocab_slice(model) * h + model.embedding_whole_params()
        return params

    def comm_ns(self, stage: int, layers: int, first: bool, last: bool,
                gemm_ns: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())) -> tuple[int, int]:
        """(ns added to F, ns added to I) of ``stage`` for its tensor-parallel collectives.

        Per layer, F and I each run two all-reduces of the activation (after the row-parallel out projection and
        MLP down; in I, before the column-parallel QKV and MLP up), or with sequence parallelism two all-gathers
        and two reduce-scatters. The vocabulary-parallel embedding all-reduces (reduce-scatters) its output in F;
        the output layer all-reduces (reduce-scatters) the gradient of its input in I, all-gathers its input in
        F under sequence parallelism, and cross-entropy all-reduces three fp32 values per token in F.

        With ``overlap`` (Transformer Engine's userbuffers, sequence parallelism only) each all-gather runs in chunks
        behind the matmul it feeds and each reduce-scatter behind the matmul it follows: a layer's pass waits only
        for what a collective takes beyond its matmul. ``gemm_ns`` gives one layer's four matmul times per pass
        (F, I), in the order the collectives pair with them: all-gather, reduce-scatter, all-gather,
        reduce-scatter.
        """
        if self.tensor < 2 or not self.times:
            return 0, 0
        c = self.times[stage]
        pair = 2 * (c.all_gather + c.reduce_scatter) if self.sequence else 2 * c.all_reduce
        to_whole = c.reduce_scatter if self.sequence else c.all_reduce
        forward = backward = layers * pair
        if self.overlap:
            if len(gemm_ns) != 2 or any(len(gemms) != 4 for gemms in gemm_ns):  # zip would drop the collectives
                raise ValueError(f"gemm_ns: got {gemm_ns!r}, expected four matmul times for F and four for I")
            collectives = (c.all_gather, c.reduce_scatter) * 2
            forward, backward = (layers * sum(max(0, comm - gemm) for comm, gemm in zip(collectives, gemms))
                                 for gemms in gemm_ns)
        if first:
            forward += to_whole
        if last:
            forward += 3 * c.token_all_reduce + (c.all_gather if self.sequence else 0)
            backward += to_whole
        return forward, backward


def collective_times(idle: IdleTimes, group: list[int], activation_bytes: int, tokens: int) -> CollectiveTimes:
    """The collectives of the tensor-parallel ``group`` (devices of the network) on an otherwise idle network
    (``routed.IdleTimes``); the collective model (``simulator/collectives.py``) picks the algorithm as for any."""
    from pipescope.simulator.ir import ActionKind as K

    def alone(kind: K, nbytes: int) -> int:
        return idle.collective(kind, group, nbytes)

    return CollectiveTimes(alone(K.ALL_REDUCE, activation_bytes), alone(K.ALL_GATHER, activation_bytes),
                           alone(K.REDUCE_SCATTER, activation_bytes), alone(K.ALL_REDUCE, 4 * tokens))


def stage_times(idle: IdleTimes, mesh: DeviceMesh, stage_to_device: list[int], activation_bytes: int,
                tokens: int) -> tuple[CollectiveTimes, ...]:
    """Per stage, its device's group times (its GPUs: ``DeviceMesh.tensor_gpus``), each distinct group priced once."""
    by_device: dict[int, CollectiveTimes] = {}
    for device in stage_to_device:
        if device not in by_device:
            group = mesh.tensor_gpus(device)
            by_device[device] = collective_times(idle, group, activation_bytes, tokens)
    return tuple(by_device[device] for device in stage_to_device)
