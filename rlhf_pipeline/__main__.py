"""`python -m rlhf_pipeline ...` is `rlhf ...` (docs/ARCHITECTURE.md, "Layers": the application layer)."""

from rlhf_pipeline.cli import entry

entry()
