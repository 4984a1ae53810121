"""The control plane: the `prl` command and what it needs on a login node (no torch, no vLLM)."""
