"""Presets: YAML files that override the defaults (`rlhf run --config <name>`); shipped as package data."""
