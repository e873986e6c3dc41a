"""Trajectory traces: schema, synthetic agentic traces, Mooncake import."""
