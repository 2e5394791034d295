"""Datasheet numbers of the GPUs the machines are built of: dense peak per precision, HBM size.

A precision the GPU cannot run at tensor-core speed is absent from its ``peak_flops``: V100 has fp16 tensor cores
but no bf16 at all (it would run emulated, far below any datasheet number), so a bf16 run on V100 is refused
rather than priced at its fp16 peak. fp32 is the plain (non-TF32) peak: torch leaves TF32 matmuls off by default.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True)
class DeviceSpec:
    """Datasheet numbers: dense tensor-core peak per precision (FLOP/s), HBM bandwidth and size."""

    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory_bytes: int

    @property
    def default_precision(self) -> str:
        """bf16 where the GPU has it, else fp16: what a mixed-precision run on it uses."""
        return "bf16" if "bf16" in self.peak_flops else "fp16"


GiB = 1 << 30
DEVICES: dict[str, DeviceSpec] = {
    "v100": DeviceSpec("V100-SXM2-32GB", {"fp16": 125e12, "fp32": 15.7e12}, 900e9, 32 * GiB),
    "a100": DeviceSpec("A100-SXM4-80GB", {"fp16": 312e12, "bf16": 312e12, "fp32": 19.5e12}, 2039e9, 80 * GiB),
    "h100": DeviceSpec("H100-SXM5-80GB", {"fp16": 989e12, "bf16": 989e12, "fp32": 67e12}, 3350e9, 80 * GiB),
    "h200": DeviceSpec("H200-SXM-141GB", {"fp16": 989e12, "bf16": 989e12, "fp32": 67e12}, 4800e9, 141 * 10**9),
}
