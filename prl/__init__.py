"""prl: SLURM-first asynchronous RL for LLMs."""
