"""The process a trainer runs in: progress lines (progress.py), stop requests (stopping.py), failures and which are
permanent (failures.py), accelerate ranks (rank.py), Ray Train jobs (ray_job.py), user code (custom.py) and what may
be trusted to load (trust.py). The ground floor of trainers/: imports no other wing."""
