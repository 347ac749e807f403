"""The benches: each measures one claim of docs/PERFORMANCE.md and exits non-zero when its verdict fails.

A bench is its own worker's operator: the runs it starts read the files it writes to a temporary folder."""

import os

os.environ.setdefault("RLHF_ALLOWED_PATHS", "*")
