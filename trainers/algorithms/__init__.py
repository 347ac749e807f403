"""The TRL-backed stages: sft.py, rm.py, dpo.py, kto.py, orpo.py, and the online pair grpo.py and rloo.py (online.py);
the fields they share (fields.py) and the training loop (loop.py). Imports rewards/, models/, data.py, config.py and
runtime/; never ppo/, pairs/ or evaluation/.

Tested through other modules' tests: fields.py, grpo.py and rloo.py (tests/trainers/algorithms/test_online.py), loop.py
(tests/trainers/algorithms/test_offline.py)."""
