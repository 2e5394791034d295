"""Numbers printed in the docs are the simulator's: each table checked here is parsed from its page and every row
rerun, so a change that moves them fails until the page is updated (one table went stale unnoticed before)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import pipescope

DOCS = Path(__file__).resolve().parent.parent / "docs"
FAULT_ROW = re.compile(r"^\| (\(none\)|`[^|]+`) \| ([0-9.]+) ms \| ([0-9.]+) ms \|$")


def _fault_rows() -> list[tuple[list[str], float, float]]:
    """docs/network.md's faults table: (extra --set values, iteration ms, exposed all-reduce ms) per row."""
    text = (DOCS / "network.md").read_text()
    table = text.split("--set KEY=VALUE --json`):", 1)[1]
    rows = []
    for line in table.splitlines():
        match = FAULT_ROW.match(line)
        if match:
            flags = match.group(1).strip("`")
            sets = [] if flags == "(none)" else [s.strip() for s in flags.split("--set")]
            rows.append((sets, float(match.group(2)), float(match.group(3))))
    return rows


def test_the_faults_table_is_found() -> None:
    assert len(_fault_rows()) == 6


@pytest.mark.parametrize("sets, iteration_ms, exposed_ms", _fault_rows())
def test_network_md_faults_table_reproduces(sets: list[str], iteration_ms: float, exposed_ms: float) -> None:
    config = pipescope.load_config("demo", ["cluster.data_parallel=4", "cluster.nodes=2", *sets])
    result = pipescope.run(config)
    assert round(result.iteration_time_s * 1e3, 3) == iteration_ms
    assert round(result.exposed_allreduce_s * 1e3, 3) == exposed_ms
