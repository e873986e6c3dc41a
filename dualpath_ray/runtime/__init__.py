"""Ray actors, topology, transport and emulation: the thin shells around the policy."""
