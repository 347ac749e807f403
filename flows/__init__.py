"""The DAGs: wiring only (docs/ARCHITECTURE.md, "Layers"). `rlhf` is the full pipeline; smaller flows reuse the same
tasks."""
