"""Everything that touches real hardware. Importing the package imports nothing: ``calibration.schema`` stays
importable without torch, for ``simulator/profiled.py``."""
