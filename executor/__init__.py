"""The real executor: a lowered program run over torch.distributed ranks (torch is imported by the modules that
run things, not here; docs/validation.md)."""
