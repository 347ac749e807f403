"""The ground floor of tasks/: a stage's key (stage.py, code_version.py), its lock, atomic publish and manifest-backed
cache (stage.py, artifacts.py), the build's resources (resources.py), its metric queue (metric_queue.py), the secrets
kept out of every record (secrets.py) and the leases that keep what a live run uses from `rlhf gc`
(leases.py). No Prefect, no MLflow: the tracking side comes in as a `Recorder` and the device
slot as `hold` (an import-linter contract keeps it so). Imports tasks/stages.py, gate.py, config.py and trainers/.

Tested through other modules' tests: artifacts.py and resources.py (tests/tasks/store/test_stage.py), code_version.py
(tests/tasks/test_stages.py), metric_queue.py (tests/tasks/tracking/test_outages.py), secrets.py
(tests/scenarios/test_secrets.py), leases.py (tests/scenarios/test_gc.py)."""
