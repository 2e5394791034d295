"""What a rank of the real executor holds in memory, tracked exactly, and its peak.

On CPU there is no allocator to ask, so the rank declares what it holds: each tensor is *held* under a category and
an owner token, and released by token. A storage counts once, at its full size, however many tensors and owners
share it (q, k, v are views of one qkv storage; a received activation is also the input the first LayerNorm
saves); while shared it counts under the category of its oldest holder. Autograd's saved tensors are held through
``torch.autograd.graph.saved_tensors_hooks`` and released when autograd drops them (after the backward that uses
them). Totals change by O(1) per event, so the peak is exact at every hold, not only between actions.

Categories: ``weights`` (every weight version), ``gradients``, ``optimizer`` (its state), ``saved`` (what autograd
saves, a stage's input, what I leaves for W), ``outputs`` (a stage's output, kept for the backward call as torch's
runtime keeps it) and ``p2p`` (receive buffers until the consuming op ends, a stage input's gradient until it is
sent, and sent tensors until the send is waited for, at the end of the iteration, as torch's runtime does). Not
tracked: transient workspace inside an op (the optimizer's temporaries, autograd's intermediate gradients), the
Python heap and allocator rounding.

On CUDA the allocator knows: ``cuda_peak`` is ``torch.cuda.max_memory_allocated`` since ``cuda_reset``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from dataclasses import dataclass, field

import torch

from pipescope.calibration.memory import storage_key

CATEGORIES = ("weights", "gradients", "optimizer", "saved", "outputs", "p2p")


@dataclass
class RankMemory:
    """One rank's measured memory: its peak, the category of the allocation that reached it, every category's
    bytes at that moment and each category's own peak, and (time ns, bytes in use) after every event."""

    peak_bytes: int = 0
    peak_category: str = ""
    at_peak: dict[str, int] = field(default_factory=dict)
    category_peaks: dict[str, int] = field(default_factory=dict)
    timeline: list[tuple[int, int]] = field(default_factory=list)


class _Saved:
    """What the pack hook hands autograd: the tensor, and a release of its hold when autograd drops it."""

    __slots__ = ("tensor", "tracker", "token")

    def __init__(self, tensor: torch.Tensor, tracker: MemoryTracker):
        self.tensor, self.tracker, self.token = tensor, tracker, object()
        if storage_key(tensor) not in tracker.gathered:  # ZeRO-3's gathered weights are freed in place, not kept
            tracker.hold(tensor, "saved", self.token)

    def __del__(self) -> None:
        self.tracker.release(self.token)


class MemoryTracker:
    """Bytes held per category, counted by storage. ``active`` switches the tracking of saved tensors, outputs and
    p2p buffers (hooks cost Python time per saved tensor, so only one iteration is tracked); static holds (weights,
    gradients, optimizer state) always count."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.active = False
        self.totals = dict.fromkeys(CATEGORIES, 0)
        self.storages: dict[tuple[str, int], tuple[int, list[str]]] = {}  # key -> (bytes, holder categories)
        self.owners: dict[Hashable, list[tuple[tuple[str, int], str]]] = {}
        self.weights: dict[int, torch.Tensor] = {}  # data_ptr -> a weight held (see ``original``)
        self.gathered: set[tuple[str, int]] = set()  # storages of weights gathered whole for a while (ZeRO-3)
        self.result = RankMemory(category_peaks=dict.fromkeys(CATEGORIES, 0))

    def hold(self, tensor: torch.Tensor, category: str, token: Hashable) -> None:
        if category == "weights":
            self.weights[tensor.data_ptr()] = tensor
        if not (self.active or category in ("weights", "gradients", "optimizer")):
            return
        key = storage_key(tensor)
        nbytes, holders = self.storages.get(key, (tensor.untyped_storage().nbytes(), []))
        if not holders:
            self.totals[category] += nbytes
        holders.append(category)
        self.storages[key] = (nbytes, holders)
        self.owners.setdefault(token, []).append((key, category))
        self._note(category)

    def hold_gathered(self, tensor: torch.Tensor, token: Hashable) -> None:
        """Weights gathered whole for a while (ZeRO-3, ``executor.zero``): held as weights; what autograd saves of
        them holds nothing more, as their storage is freed in place when they are resharded (FSDP's way), not kept
        alive by the saved tensors."""
        self.gathered.add(storage_key(tensor))
        self.hold(tensor, "weights", token)

    def release_gathered(self, tensor: torch.Tensor, token: Hashable) -> None:
        """``hold_gathered`` undone, before the storage is freed (its address is the key)."""
        self.gathered.discard(storage_key(tensor))
        self.release(token)

    def release(self, token: Hashable) -> None:
        for key, category in self.owners.pop(token, ()):
            nbytes, holders = self.storages[key]
            counted = holders[0]
            holders.remove(category)
            self.totals[counted] -= nbytes
            if holders:
                self.totals[holders[0]] += nbytes  # the oldest remaining holder counts it now
            else:
                del self.storages[key]
        self._note(None)

    def _note(self, category: str | None) -> None:
        total = sum(self.totals.values())
        peaks = self.result.category_peaks
        for name, value in self.totals.items():
            if value > peaks[name]:
                peaks[name] = value
        if self.active:
            self.result.timeline.append((self.clock(), total))
        if category is not None and total > self.result.peak_bytes:
            self.result.peak_bytes, self.result.peak_category = total, category
            self.result.at_peak = dict(self.totals)

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Track what autograd saves inside the block (a forward), while active."""
        if not self.active:
            yield
            return
        with torch.autograd.graph.saved_tensors_hooks(lambda t: _Saved(t, self), lambda saved: saved.tensor):
            yield

    def original(self, tensor: torch.Tensor) -> torch.Tensor:
        """The weight a saved tensor aliases: what autograd unpacks under hooks is a new tensor object on the
        weight's storage, and the deferred Linears accumulate into the ``.grad`` of the weight they unpack."""
        weight = self.weights.get(tensor.data_ptr())
        if weight is not None and weight.shape == tensor.shape and weight.stride() == tensor.stride():
            return weight
        return tensor


def cuda_reset(device: torch.device) -> None:
    """Start a CUDA peak measurement: everything allocated from here on counts."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)


def cuda_peak(device: torch.device) -> RankMemory:
    """The CUDA allocator's peak since ``cuda_reset``: every live tensor, workspace included (no categories)."""
    torch.cuda.synchronize(device)
    peak = int(torch.cuda.max_memory_allocated(device))
    return RankMemory(peak, "cuda allocator", {"cuda allocator": peak}, {"cuda allocator": peak})
