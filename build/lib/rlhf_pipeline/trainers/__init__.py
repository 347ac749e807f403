"""Pure training code, no Prefect: every stage's config and `train` function, usable from plain Python."""
