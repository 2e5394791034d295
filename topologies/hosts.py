"""The host side of each built-in machine: its CPUs' memory, which ZeRO-Offload keeps the optimizer state in and
steps it from (docs/parallelism.md, "Offload").

A host's memory rate is its DRAM's datasheet rate (channels x transfers/s x 8 bytes) times the fraction that the
STREAM triad benchmark reaches on a server of the same memory generation: the streaming rate a CPU optimizer step
gets, as a GPU's ``memory_efficiency`` is the rate its streaming kernels get.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipescope.topologies.devices import GiB

GB = 1e9
TiB = 1 << 40  # DIMMs come in binary sizes: 2 TB of them is 32 x 64 GiB
# STREAM triad over the datasheet rate, measured by Azure on its HPC VMs (learn.microsoft.com, "STREAM benchmark",
# expected results by VM family): HBv3, 2 x EPYC Milan-X on 16 channels of DDR4-3200 (409.6 GB/s), 330-350 GB/s;
# HBv4, 2 x EPYC Genoa-X on 24 channels of DDR5-4800 (921.6 GB/s), 650-780 GB/s. The middle of each range.
DDR4_STREAM = 340 * GB / (16 * 3200e6 * 8)
DDR5_STREAM = 715 * GB / (24 * 4800e6 * 8)


@dataclass(frozen=True)
class Host:
    """One machine's CPUs and memory: ``memory_bytes`` in all, ``memory_rate`` bytes/s of it a streaming pass
    reaches (every CPU socket together)."""

    cpus: str
    memory_bytes: int
    memory_rate: float


def _dram(channels: int, transfers_per_s: float, stream: float) -> float:
    """The rate a streaming pass reaches on ``channels`` DDR channels (8 bytes a transfer)."""
    return channels * transfers_per_s * 8 * stream


# Datasheets: DGX A100 user guide (2 x AMD EPYC 7742, 8 channels of DDR4-3200 each, 2 TB in the 640 GB system);
# DGX H100 user guide (2 x Intel Xeon Platinum 8480C, 8 channels of DDR5-4800 each, 2 TB); HGX H200 boards ship in
# the same 2-socket servers; AWS p3.16xlarge (2 x Xeon E5-2686 v4, 4 channels of DDR4-2400 each, 488 GiB) and
# p3dn.24xlarge (2 x Xeon Platinum 8175M, 6 channels of DDR4-2666 each, 768 GiB). The PCIe box is assumed to be
# built like a DGX A100's host, with 1 TB.
HOSTS: dict[str, Host] = {
    "dgx-a100": Host("2 x AMD EPYC 7742", 2 * TiB, _dram(16, 3200e6, DDR4_STREAM)),
    "dgx-h100": Host("2 x Intel Xeon Platinum 8480C", 2 * TiB, _dram(16, 4800e6, DDR5_STREAM)),
    "hgx-h200": Host("2 x Intel Xeon Platinum 8480C", 2 * TiB, _dram(16, 4800e6, DDR5_STREAM)),
    "p3.16xlarge": Host("2 x Intel Xeon E5-2686 v4", 488 * GiB, _dram(8, 2400e6, DDR4_STREAM)),
    "p3dn.24xlarge": Host("2 x Intel Xeon Platinum 8175M", 768 * GiB, _dram(12, 2666e6, DDR4_STREAM)),
    "pcie-box": Host("2 x AMD EPYC 7742 (assumed)", TiB, _dram(16, 3200e6, DDR4_STREAM)),
}
