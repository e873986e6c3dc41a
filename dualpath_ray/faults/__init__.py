"""Fault injection driven by the config's `faults` plan (see docs/reliability.md):
plan.py (the config section), injector.py (per-process decisions and counters), ports.py (the
engines' ports with faults applied), store.py (damage to stored blocks)."""
