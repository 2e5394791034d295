"""The file and table readers: units, bounded YAML, files written atomically, the schedule CSV, table bounds and the
profile schema. Standard library (and pyyaml for safe_yaml) only, so calibration/ and executor/ use them on a GPU
box without the simulator's dependencies (docs/architecture.md)."""
