"""Counting bytes exactly: what autograd stashes (saved-tensor hooks) and the CUDA peak during backward."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def saved_tensor_bytes(forward: Callable[[], Any], exclude: Iterable[torch.Tensor] = ()) -> tuple[int, Any]:
    """Run ``forward`` and count the bytes autograd saves for its backward.

    Counts each distinct storage once at its full size (views such as q, k, v of one qkv tensor share one
    storage, and a view keeps its whole storage alive). Storages of ``exclude`` (the parameters, which a
    stage holds anyway) are not activations and are left out. The pack hook returns the tensor itself, so
    every counted storage stays alive until the backward and no address can be reused for another.

    Returns:
        (bytes, what ``forward`` returned).
    """
    excluded = {storage_key(t) for t in exclude}
    seen: dict[tuple[str, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if storage_key(tensor) not in excluded:
            seen[storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        result = forward()
    return sum(seen.values()), result


def storage_key(tensor: torch.Tensor) -> tuple[str, int]:
    """Identifies a tensor's storage: its device and address (a CPU and a GPU address may coincide)."""
    return str(tensor.device), tensor.untyped_storage().data_ptr()


def peak_backward_bytes(device: torch.device, backward: Callable[[], Any]) -> float:
    """Bytes allocated at the peak of ``backward`` above what was allocated when it started (CUDA only).

    On CPU there is no allocator peak to read, so the answer is NaN.
    """
    if device.type != "cuda":
        return float("nan")
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    backward()
    torch.cuda.synchronize(device)
    return float(torch.cuda.max_memory_allocated(device) - before)
