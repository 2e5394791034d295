"""A GPU's measured matmul rates (``pipescope calibrate-gemms``), in place of its published large-GEMM rate
(docs/costs.md, "Measured GEMMs").

A matmul of the analytic model takes the rate measured at the nearest shape (distance on log2 of rows, columns and
inner size), scaled by what ``Tiling`` says changes between the two shapes (waves, overhanging tiles, pipeline
fill): at a measured shape the measurement itself, elsewhere the model anchored at the nearest measurement, as the
published rate anchors it at its benchmark's one shape.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from pipescope.simulator.readers import profile_schema as schema
from pipescope.simulator.gpu_rates import Tiling
from pipescope.simulator.kernels import Gemm
from pipescope.simulator.readers.profile_schema import MAX_GEMM_SHAPES, ProfileError
from pipescope.simulator.readers.units import short_repr


@dataclass(frozen=True)
class MeasuredGemms:
    """(m, n, k, FLOP/s) of each measured (m x k) by (k x n) matmul, and the metadata it came with."""

    points: tuple[tuple[int, int, int, float], ...]
    meta: dict = field(default_factory=dict, compare=False)  # where it was measured; not part of the rates

    def flop_rate(self, gemm: Gemm, tiling: Tiling | None) -> float:
        """FLOP/s of ``gemm``: the nearest measured shape's rate, times the ratio of the two shapes' tiling
        efficiencies (1 without ``tiling``), and never above the fastest rate measured (a small measured shape
        that cuBLAS ran with small tiles would otherwise scale past it)."""
        logs = np.log2([point[:3] for point in self.points])
        nearest = int(np.argmin(((logs - np.log2([gemm.rows, gemm.cols, gemm.inner])) ** 2).sum(axis=1)))
        m, n, k, rate = self.points[nearest]
        if tiling is not None:
            rate *= tiling.efficiency(gemm.batch, gemm.rows, gemm.cols, gemm.inner) / tiling.efficiency(1, m, n, k)
        return min(rate, self.fastest()[1])

    def fastest(self) -> tuple[tuple[int, int, int], float]:
        """The measured shape with the highest rate, and that rate."""
        m, n, k, rate = max(self.points, key=lambda point: point[3])
        return (m, n, k), rate

    @property
    def device_name(self) -> str:
        device = self.meta.get("device")
        return str(device.get("name", "")) if isinstance(device, dict) else ""


def load_gemms(folder: str | os.PathLike, precision: str) -> MeasuredGemms:
    """The checked table of a ``pipescope calibrate-gemms`` folder, measured in ``precision``.

    Raises:
        ProfileError: a missing or malformed gemms.json or table, another precision than the run's, a shape
            measured twice, no rows, or more rows than calibrate-gemms writes (MAX_GEMM_SHAPES).
    """
    from pipescope.simulator.profiled import read_table  # pandas: only when a table is asked for

    meta = schema.read_metadata(folder, schema.GEMMS_META)
    measured = meta.get("precision", "fp32")
    if measured != precision:
        raise ProfileError(f"measured in {short_repr(measured)}; expected the run's precision {precision} (a "
                           "matmul's rate depends on it: re-run calibrate-gemms with --precision)")
    frame = read_table(folder, meta, "gemms")
    if not 1 <= len(frame) <= MAX_GEMM_SHAPES:
        raise ProfileError(f"the gemms table has {len(frame)} rows; expected 1 to {MAX_GEMM_SHAPES} measured shapes")
    shapes = frame[["m", "n", "k"]]
    if shapes.duplicated().any():
        row = int(shapes.duplicated().to_numpy().argmax())
        raise ProfileError(f"the gemms table measures {' x '.join(str(int(v)) for v in shapes.iloc[row])} twice "
                           f"(row {row + 1}); expected each shape once")
    points = tuple((int(m), int(n), int(k), 2 * m * n * k / (ns * 1e-9))
                   for m, n, k, ns in frame[["m", "n", "k", "median_ns"]].itertuples(index=False))
    return MeasuredGemms(points, meta)
