"""The Prefect side: a stage as a retried task with its device slot (stage_task.py), its progress artifact
(progress_artifact.py), the registry's events (events.py), launched ranks (launcher.py) and the flow's parent run
(parent_run.py). Imports tracking/, store/ and the bottom of tasks/.

Tested through other modules' tests: stage_task.py (tests/tasks/orchestration/test_failures.py)."""
