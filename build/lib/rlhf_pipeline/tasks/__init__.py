"""One Prefect task per stage, and the stage machinery they share (key, publish, cache, MLflow child run)."""
