"""The DAGs: wiring only. `rlhf` is the full pipeline; smaller flows reuse the same tasks."""
