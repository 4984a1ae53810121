"""The run protocol: the run directory, the lifecycle, the contracts between the three programs."""
