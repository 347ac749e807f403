"""Deployments of the `rlhf` flows, `rlhf serve` and `rlhf up`, and the environment of every flow-run process
(`deployments.env`; docs/ARCHITECTURE.md, "Layers")."""
