"""rlhf-pipeline: RLHF post-training as Prefect flows (data -> sft -> rm -> dpo | kto | grpo | rloo | ppo -> eval -> registry).

The one import package of the distribution. Its subpackages live in the
repository's top-level folders (`flows/` is `rlhf_pipeline.flows`, `tasks/` is
`rlhf_pipeline.tasks`, ...): pyproject.toml maps them, so an editable install
and a wheel import the same names. Start at `rlhf_pipeline.tasks.stages`, the
table of stages.
"""
