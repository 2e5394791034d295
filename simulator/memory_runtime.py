"""Whose accounting the memory ledger follows: the ``memory.runtime`` key (docs/memory.md "Runtimes").

Three training runtimes hold different buffers around the same program:

- ``megatron`` (the default): a stage's output is freed once sent (``deallocate_output_tensor``), so only the
  send's copy is held until the transfer arrives, and a received buffer until its consumer starts. Under bf16 the
  gradients are Megatron's fp32 ``main_grad``: 4 bytes per parameter, not 2.
- ``deepspeed`` (Megatron-DeepSpeed: Megatron's model under DeepSpeed's pipeline engine and BF16 optimizer): the
  engine keeps a stage's output in its pipe buffers until that microbatch's backward; under bf16 the optimizer
  accumulates autograd's bf16 gradients into an fp32 copy of them and keeps both (4 + 2 bytes per parameter, not
  sharded), and reduces the fp32 one.
- ``torch`` (torch.distributed.pipelining's runtime, which pipescope's executor mirrors): a stage's output is kept
  until its backward, and everything a rank sends (outputs and input gradients) until the end of the step, where
  all sends are waited for. A receive buffer is taken when the receive is posted (its place in the device's list)
  and a received gradient is held until its backward ends. AdamW keeps a 4-byte step counter per parameter tensor.

``simulator.memory.ledger`` calls ``buffer_events`` with the runtime's rule; the rest of the ledger is shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pipescope.simulator.ir import ActionKind, Role
from pipescope.simulator.models import MEGATRON_MODEL, PRECISIONS
from pipescope.simulator.program import KIND_CODE, RECEIVED_FROM, SENT_BY, ActionIndex
from pipescope.simulator.timeline import Timeline

K = ActionKind
RUNTIMES = ("megatron", "deepspeed", "torch")
MAIN_GRAD_BYTES = 4  # Megatron's fp32 main_grad, whatever the compute precision
STEP_COUNTER_BYTES = 4  # torch AdamW's per-tensor ``step``, a float32 scalar


MEMORY_RANGES: dict[str, tuple[int, int]] = {"cuda_context": (0, 1 << 40), "nccl_communicator": (0, 1 << 40)}


@dataclass(frozen=True)
class MemoryConfig:
    """The ``memory`` section: ``runtime``, one of ``RUNTIMES``: whose buffers the ledger counts; ``cuda_context``
    and ``nccl_communicator``: bytes of the CUDA context and of one NCCL communicator on each GPU (unset: the
    measurements of ``simulator/memory_overheads.py``; analytic costs only)."""

    runtime: str = "megatron"
    cuda_context: int | None = field(default=None, metadata={"unit": "size"})
    nccl_communicator: int | None = field(default=None, metadata={"unit": "size"})


def grad_bytes(runtime: str, precision: str) -> int:
    """Bytes per parameter of the gradient buffer the runtime keeps, which the data-parallel reduction also moves:
    Megatron accumulates and all-reduces a bf16 model's gradients in fp32 (``megatron/arguments.py`` turns on
    ``accumulate_allreduce_grads_in_fp32`` with ``--bf16``) and an fp16 model's in fp16; torch keeps the parameters'
    precision. DeepSpeed's BF16 optimizer reduces an fp32 copy too (``fp32_groups_gradients_flat``)."""
    if runtime in MEGATRON_MODEL and precision == "bf16":
        return MAIN_GRAD_BYTES
    return PRECISIONS[precision].grad_bytes


def held_grad_bytes(runtime: str, precision: str) -> int:
    """Bytes per parameter of every gradient the runtime holds through the step: ``grad_bytes``, and under
    DeepSpeed's BF16 optimizer autograd's bf16 gradients besides, which it accumulates into its fp32 copy after each
    backward without freeing them (``update_hp_grads(clear_lp_grads=False)`` in DeepSpeed's pipeline engine; BLOOM's
    notes: "the additional memory usage is 4bytes x params and it's not sharded across gpus")."""
    extra = PRECISIONS[precision].grad_bytes if runtime == "deepspeed" and precision == "bf16" else 0
    return grad_bytes(runtime, precision) + extra


def step_counter_bytes(runtime: str) -> int:
    """Bytes per parameter tensor of the optimizer's step count: torch's AdamW keeps a float32 tensor per parameter
    (not fused, not capturable), Megatron's fused optimizers one number per parameter group."""
    return STEP_COUNTER_BYTES if runtime == "torch" else 0


def buffer_events(records: Timeline, boundary_bytes: np.ndarray, runtime: str,
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Held buffers as (device, since, until, bytes) arrays: p2p buffers and, under ``torch`` and ``deepspeed``,
    stage outputs.

    Args:
        records: a timeline (of a replay, or measured compute rows only: then there are no transfers).
        boundary_bytes: per stage, the bytes of its output (and of its input's gradient).
        runtime: one of ``RUNTIMES``.
    """
    stage, microbatch, end = records.stage, records.microbatch, records.end
    compute = np.flatnonzero(records.mask(Role.COMPUTE))
    ops = ActionIndex(stage[compute], records.kind[compute], microbatch[compute], compute,
                      int(microbatch.max(initial=0)) + 2)
    sends, recvs = np.flatnonzero(records.is_kind(*SENT_BY)), np.flatnonzero(records.is_kind(*RECEIVED_FROM))
    producer = ops.compute_op(stage[sends], microbatch[sends], records.is_kind(K.SEND_B)[sends])
    backward_recv = records.is_kind(K.RECV_B)[recvs]
    consumer = ops.compute_op(stage[recvs], microbatch[recvs], backward_recv)
    produced = np.where(producer >= 0, end[producer], records.start[sends])
    consumer_start = np.where(consumer >= 0, records.start[consumer], 0)
    if runtime != "torch":
        # DeepSpeed's pipe buffer is the output itself (counted by _outputs), so only gradient sends are held here
        held = np.ones(len(sends), dtype=bool) if runtime == "megatron" else records.is_kind(K.SEND_B)[sends]
        held_sends = (records.device[sends][held], produced[held], end[sends][held], records.nbytes[sends][held])
        consumed = np.maximum(end[recvs], consumer_start)
        parts = [held_sends, (records.device[recvs], records.start[recvs], consumed, records.nbytes[recvs])]
        if runtime == "deepspeed":
            parts.append(_outputs(records, ops, compute, boundary_bytes, _run_end(records), until_step_end=False))
        return _joined(parts)
    run_end = _run_end(records)
    consumer_end = np.where(consumer >= 0, end[consumer], 0)
    consumed = np.maximum(end[recvs], np.where(backward_recv, consumer_end, consumer_start))
    gradients = records.is_kind(K.SEND_B)[sends]  # an output's send is the output itself: counted below
    held_grads = (records.device[sends][gradients], produced[gradients], run_end[records.device[sends][gradients]],
                  records.nbytes[sends][gradients])
    posted = _posted(records)[recvs]
    held_recvs = (records.device[recvs], posted, np.maximum(consumed, posted), records.nbytes[recvs])
    return _joined([held_grads, held_recvs, _outputs(records, ops, compute, boundary_bytes, run_end, True)])


def _posted(records: Timeline) -> np.ndarray:
    """Per row, when its device posted it: the end of the last compute op before it in the device's list (rows are
    in program order), or 0. torch's ``irecv`` takes its buffer then, however late the data comes."""
    ends = np.where(records.mask(Role.COMPUTE), records.end, 0)
    posted = np.zeros(len(ends), dtype=np.int64)
    for device in range(records.num_devices):
        rows = np.flatnonzero(records.device == device)
        if rows.size:
            posted[rows] = np.concatenate([[0], np.maximum.accumulate(ends[rows])[:-1]])
    return posted


def _outputs(records: Timeline, ops: ActionIndex, compute: np.ndarray, boundary_bytes: np.ndarray,
             run_end: np.ndarray, until_step_end: bool) -> tuple[np.ndarray, ...]:
    """Every forward's output but the last stage's (a loss): from its end until its backward ends, or, with
    ``until_step_end``, until the end of the step when it was sent (torch waits for all sends there)."""
    last = len(boundary_bytes) - 1
    forwards = compute[(records.kind[compute] == KIND_CODE[K.F]) & (records.stage[compute] < last)]
    stage, microbatch, device = records.stage[forwards], records.microbatch[forwards], records.device[forwards]
    backward = ops.compute_op(stage, microbatch, np.ones(len(forwards), dtype=bool))
    until = np.where(backward >= 0, records.end[np.maximum(backward, 0)], run_end[device])
    if until_step_end:
        sends = np.flatnonzero(records.is_kind(K.SEND_F))
        sent_index = ActionIndex(records.stage[sends], records.kind[sends], records.microbatch[sends], sends,
                                 int(records.microbatch.max(initial=0)) + 2)
        sent = sent_index.find(stage, KIND_CODE[K.SEND_F], microbatch) >= 0
        until = np.where(sent, np.maximum(until, run_end[device]), until)
    return device, records.end[forwards], until, boundary_bytes[stage]


def _run_end(records: Timeline) -> np.ndarray:
    """Per device, the end of its last op before the flush's steps (where torch waits for the sends)."""
    ops = records.mask(Role.COMPUTE) & ~records.is_kind(K.OPT)
    out = np.zeros(records.num_devices, dtype=np.int64)
    np.maximum.at(out, records.device[ops], records.end[ops])
    return out


def _joined(parts: list[tuple[np.ndarray, ...]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    return tuple(np.concatenate([np.asarray(p[i], dtype=np.int64) for p in parts]) for i in range(4))
