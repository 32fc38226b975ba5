"""Typed configuration: one TOML per deployment, CLI overrides, and its generated reference
(docs/configuration.md)."""
