"""The decoder model (layerwise) and its latency model."""
