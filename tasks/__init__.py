"""One Prefect task per stage, and the stage machinery they share (docs/ARCHITECTURE.md, "Stages and the table",
"Artifacts and the cache key").

Its wings, top to bottom (a wing imports only those below it; `lint-imports` keeps the order):
the task modules (training.py, data.py, pairs.py, people.py, eval.py, registry.py) > labels.py (people's labels:
their file's rules and their store) > orchestration/ (Prefect) > tracking/ (MLflow) > store/ (key, lock, publish,
cache) > the table and the config they all read (stages.py, gate.py, config.py).

Tested through other modules' tests: config.py (tests/tasks/orchestration/test_launcher.py), gate.py
(tests/tasks/test_registry.py), pairs.py (tests/scenarios/test_pairs.py), people.py
(tests/deployments/test_people.py)."""
