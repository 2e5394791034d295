"""Everything that touches real hardware (torch is imported by the modules that time things, not here)."""
