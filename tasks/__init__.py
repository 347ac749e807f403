"""One Prefect task per stage, and the stage machinery they share: the table of stages, the artifact store (key,
publish, cache, MLflow child run) and the orchestration (docs/ARCHITECTURE.md, "Stages and the table", "Artifacts and
the cache key")."""
