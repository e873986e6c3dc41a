"""Watching a running cluster: the Grafana dashboard's panels, Prometheus, `dualpath status`."""
