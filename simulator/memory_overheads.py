"""What a GPU's memory holds besides the model's tensors (docs/memory.md, "Beyond the tensors"): the CUDA context
with the kernels the process loaded, NCCL's buffers for each communicator the run uses, and cuBLAS's workspace.
Each is held from the first step to the end of the run, so the ledger counts them as static bytes of every device.
Each is a named measurement; the ``memory`` section's keys replace them for another software stack.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 1 << 30
# A100 80GB, torch 2.1.1 with CUDA's lazy module loading (its default since CUDA 11.7): 0.47 GiB used once a tensor
# is on the GPU; 0.92 GiB with eager loading, 1.78 GiB under torch 1.10.2 (stas00/ml-engineering,
# training/performance/README.md, "Preloaded CUDA kernels memory usage").
CUDA_CONTEXT_BYTES = int(0.47 * GIB)
# One NCCL communicator over more than two A100s, after its first all-reduce: 688 MB (NVIDIA/nccl#964, 4 x A100 on
# NVLink, PyTorch). NCCL sizes its buffers per channel and peer (4 MiB Simple, 4.69 MiB LL128, 512 KiB LL), so a
# communicator costs about this much whatever the model.
NCCL_COMMUNICATOR_BYTES = 688 * 10**6
# torch's cuBLAS workspace per handle and stream: 32 MiB on Hopper, 4096 KiB x 2 + 16 KiB x 8 elsewhere
# (pytorch/pytorch aten/src/ATen/cuda/CublasHandlePool.cpp).
HOPPER_WORKSPACE_BYTES = 32 << 20
WORKSPACE_BYTES = 4096 * 1024 * 2 + 16 * 1024 * 8
HOPPER = ("h100", "h200")
# What nvidia-smi sees beyond torch's counters: the caching allocator keeps freed blocks for reuse and cannot merge
# blocks across its segments, so the memory it has reserved from CUDA runs above the most it handed out at once. The
# median of max reserved / max allocated over the 587 rank reports ("(after N iterations) memory (MB)") in the
# Megatron-LM and Megatron-DeepSpeed training logs of bigscience-workshop/bigscience (commit 9e64ede,
# experiments/gpt2-meg*/*.out: Jean Zay, 2021, tensor 4 and pipeline 4-64): quartiles 1.199 and 1.235, range
# 1.061-1.397 (docs/memory.md, "What nvidia-smi sees").
ALLOCATOR_RESERVE = 1.209


@dataclass(frozen=True)
class Overheads:
    """Bytes one GPU holds besides the model's tensors."""

    cuda_context: int = 0
    nccl: int = 0
    workspace: int = 0

    @property
    def total(self) -> int:
        return self.cuda_context + self.nccl + self.workspace

    def as_dict(self) -> dict[str, int]:
        return {"cuda_context": self.cuda_context, "nccl": self.nccl, "workspace": self.workspace}


def nvidia_smi_bytes(peak: int, overheads: Overheads) -> int:
    """What nvidia-smi would show of a device whose ledger peaks at ``peak`` (overheads included): the CUDA context
    and NCCL's buffers as they are, the tensors at the caching allocator's reserve (``ALLOCATOR_RESERVE``; the
    cuBLAS workspace is the allocator's too)."""
    outside = overheads.cuda_context + overheads.nccl
    return outside + math.ceil((peak - outside) * ALLOCATOR_RESERVE)


NO_OVERHEADS = Overheads()  # a run that models no GPU process (uniform or profiled costs)


def communicators(tensor: int, pipeline: int, data: int, context: int = 1, hybrid: bool = False) -> int:
    """NCCL communicators a Megatron-style GPU uses: one per parallel axis wider than one (tensor, pipeline,
    context), one over the ranks that reduce its gradients (data x context: Megatron's data-parallel group with
    context parallelism), and one over the model-parallel ranks, which the gradient norm and loss all-reduce use.
    ``hybrid`` (HSDP): the gradients go over two groups, the shard group and the replicate group (torch's 2-D
    device mesh), one communicator each."""
    axes = sum(width > 1 for width in (tensor, pipeline, context, data * context))
    return axes + (hybrid and data > 1) + (tensor * pipeline > 1)


def overheads(device: str, tensor: int, pipeline: int, data: int, cuda_context: int | None = None,
              nccl_communicator: int | None = None, context: int = 1, hybrid: bool = False) -> Overheads:
    """A GPU's overheads: the measured defaults unless ``cuda_context`` / ``nccl_communicator`` bytes are given;
    ``context`` and ``hybrid`` as ``communicators`` takes them."""
    cuda = CUDA_CONTEXT_BYTES if cuda_context is None else cuda_context
    per_communicator = NCCL_COMMUNICATOR_BYTES if nccl_communicator is None else nccl_communicator
    workspace = HOPPER_WORKSPACE_BYTES if device in HOPPER else WORKSPACE_BYTES
    return Overheads(cuda, per_communicator * communicators(tensor, pipeline, data, context, hybrid), workspace)
