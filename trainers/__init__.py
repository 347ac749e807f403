"""Pure training code, no Prefect, no MLflow: every stage's config and `train` function, usable from plain Python (the
bottom layer: docs/ARCHITECTURE.md, "Layers"; the contract: "The trainer contract")."""
