"""KV bytes: block layout, prefix index, block stores, host buffer pools."""
