"""`python -m rlhf_pipeline ...` is `rlhf ...` (docs/ARCHITECTURE.md, "Layers": the application layer)."""

import sys

from rlhf_pipeline.cli import main

sys.exit(main())
