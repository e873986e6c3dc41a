"""Subcommands of the `dualpath` CLI, one module each."""
