"""Deployments of the `rlhf` flows and the `serve` entry point (`rlhf serve`)."""
