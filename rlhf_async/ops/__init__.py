"""Operating a deployment: the daemon, plots of a run's metrics, host checks, offline model
preparation."""
