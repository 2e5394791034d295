"""Context parallelism (docs/parallelism.md, "Context parallelism"): each pipeline device is ``tensor x context``
GPUs, and the ``context`` GPUs of one tensor rank split the sequence. Each holds ``s / cp`` of the tokens (two
chunks of ``s / 2cp``, one from each end, so the causal attention's work is balanced: Megatron-LM's load balancing)
and runs the block's matmuls, norms and activations on them; its queries attend to every key, so the keys and values
of the whole sequence reach every GPU of the group:

- ``p2p`` (Megatron-LM's default, ring attention): ``cp - 1`` ring steps per layer in F, each GPU sending the block
  of keys and values it holds to the next while it computes attention against the block it has; in I the blocks
  travel again with their gradients (twice the bytes). A step costs what its transfer takes beyond its block of
  attention: ``max(0, send - attention / cp)``.
- ``all_gather`` (Llama 3's): the keys and values are all-gathered before attention in F and in I, and their
  gradients reduce-scattered after I, none of it overlapped.

The gradients of the ``cp`` copies of the weights are all-reduced over the group once an iteration, before the
optimizer step (charged to the step, not overlapped). Times are priced on the idle network of each device's group,
as the tensor-parallel collectives are (``simulator/parallel.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from pipescope.simulator.mesh import DeviceMesh
from pipescope.simulator.readers.units import short_repr

if TYPE_CHECKING:
    from pipescope.simulator.routed import IdleTimes

CONTEXT_COMMS = ("p2p", "all_gather")  # parallel.context_comm


@dataclass(frozen=True)
class ContextTimes:
    """ns on the idle network of one device's context group: one ring step of a key/value block (every GPU sending
    to the next at once), the all-gather of the whole keys and values and the reduce-scatter of their gradients,
    and the all-reduce of the stage's gradients."""

    ring_step: int = 0
    gather: int = 0
    scatter: int = 0
    grad_all_reduce: int = 0


def check_context(context: int, comm: str, tensor: int, seq: int | None, attention: str | None,
                  gpus_per_node: int | None) -> None:
    """ValueError naming the key unless ``context`` x ``tensor`` GPUs fit a node's, ``2 x context`` divides the
    sequence and the attention is flash. ``None``: not checked."""
    if comm not in CONTEXT_COMMS:
        raise ValueError(f"parallel.context_comm: got {short_repr(comm)}, expected one of {', '.join(CONTEXT_COMMS)}")
    if context == 1:
        return
    problem = span_problem(tensor, context, gpus_per_node) if gpus_per_node is not None else None
    if problem:
        raise ValueError(problem)
    if seq is not None and seq % (2 * context):
        raise ValueError(f"parallel.context: got {context}, expected 2 x context to divide model.seq (={seq}): each "
                         f"GPU holds two chunks of the sequence")
    if attention is not None and attention != "flash":
        raise ValueError(f"parallel.context: got {context} with model.attention {attention}, expected flash "
                         f"(context parallelism splits flash attention's blocks)")


def span_problem(tensor: int, context: int, per_node: int, machine: str = "") -> str | None:
    """Why a device of ``tensor`` x ``context`` GPUs cannot be placed on nodes of ``per_node`` GPUs, or None: its GPUs
    share one node, or, with context parallelism, fill whole nodes (the context group crosses them; each tensor group
    stays in one node, as Llama 3's context parallelism ran across nodes). ``machine`` names the nodes' machine."""
    gpus, nodes = tensor * context, f"{per_node} GPUs per node" + (f" of {machine}" if machine else "")
    if per_node % gpus == 0 or (context > 1 and gpus % per_node == 0 and per_node % tensor == 0):
        return None
    if context == 1:
        return (f"parallel.tensor: got {tensor}, expected a divisor of the {nodes} (a stage's tensor-parallel GPUs "
                f"share one node)")
    return (f"parallel.context: got {context} with parallel.tensor {tensor}, expected context x tensor to divide the "
            f"{nodes}, or to be a multiple of them with tensor dividing them (a device's GPUs share one node or fill "
            f"whole nodes)")


def exposed_ns(times: ContextTimes, context: int, comm: str, layers: int, attention_ns: tuple[int, int]
               ) -> tuple[int, int]:
    """(ns added to F, ns added to I) of a stage of ``layers`` blocks for its context-parallel exchange (the module
    doc); ``attention_ns``: one block's attention time in F and in I on one GPU."""
    if context < 2:
        return 0, 0
    if comm == "all_gather":
        return layers * times.gather, layers * (times.gather + times.scatter)
    steps = context - 1
    forward = steps * max(0, times.ring_step - attention_ns[0] // context)
    backward = steps * max(0, 2 * times.ring_step - attention_ns[1] // context)
    return layers * forward, layers * backward


def context_times(idle: IdleTimes, mesh: DeviceMesh, stage_to_device: list[int], block_bytes: int,
                  kv_bytes: int, grad_bytes: list[int]) -> tuple[ContextTimes, ...]:
    """Per stage, its device's context group's times on the idle network (``routed.IdleTimes``): a ring step of
    ``block_bytes`` (one GPU's keys and values), the all-gather and reduce-scatter of ``kv_bytes`` (the whole
    sequence's) and the all-reduce of the stage's gradient bytes (``grad_bytes``, one GPU's)."""
    from pipescope.simulator.ir import ActionKind as K

    exchange: dict[int, ContextTimes] = {}  # per device: what its stages share (an interleaved device has several)
    out = []
    for stage, device in enumerate(stage_to_device):
        group = mesh.context_gpus(device)
        if device not in exchange:
            ring = [(src, group[(i + 1) % len(group)], block_bytes, 0) for i, src in enumerate(group)]
            exchange[device] = ContextTimes(idle.transfers(ring), idle.collective(K.ALL_GATHER, group, kv_bytes),
                                            idle.collective(K.REDUCE_SCATTER, group, kv_bytes))
        out.append(replace(exchange[device], grad_all_reduce=idle.collective(K.ALL_REDUCE, group, grad_bytes[stage])))
    return tuple(out)
