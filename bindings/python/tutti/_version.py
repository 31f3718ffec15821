"""The package's version: the libtutti version it is built from (the workspace's Cargo.toml)."""

__version__ = "0.1.0"
