"""The process a trainer runs in: progress lines (progress.py), stop requests (stopping.py), failures and which are
permanent (failures.py), accelerate ranks (rank.py), Ray Train jobs (ray_job.py), user code (custom.py), what may
be trusted to load (trust.py) and the heartbeat whose watchdog fails a stalled
stage (heartbeat.py). The ground floor of trainers/: imports no other wing.

Tested through other modules' tests: failures.py (tests/tasks/orchestration/test_failures.py), progress.py
(tests/tasks/orchestration/test_progress_artifact.py), rank.py (tests/tasks/orchestration/test_launcher.py), stopping.py
(tests/scenarios/test_crash_resume.py), trust.py (tests/scenarios/test_trust.py), heartbeat.py
(tests/scenarios/test_stalls.py)."""
