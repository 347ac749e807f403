"""Pure training code, no Prefect, no MLflow: every stage's config and `train` function, usable from plain Python (the
bottom layer: docs/ARCHITECTURE.md, "Layers"; the contract: "The trainer contract").

Its wings, top to bottom (a wing imports only those below it; `lint-imports` keeps the order):
ppo/, pairs/, evaluation/ > algorithms/ > rewards/ > models/, data.py > config.py > runtime/, attention.py.

Tested through other modules' tests: config.py (tests/trainers/test_attention.py and every stage's tests)."""
