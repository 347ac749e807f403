"""Loading and handing models on: tokenizers and models (load.py), the base model's source (base_model.py), what a
stage hands the next (handoff.py), checkpoints (checkpoints.py), the tiny model (tiny.py), chat templates
(templates.py), text and token lengths (text.py), the decoding loop (decode.py) and memory estimates (memory.py).
Imports config.py, runtime/ and attention.py.

Tested through other modules' tests: base_model.py and load.py (tests/trainers/models/test_checkpoints.py), memory.py
(tests/app/test_check.py), text.py (tests/trainers/models/test_templates.py; its generation, test_decode.py)."""
