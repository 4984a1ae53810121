"""The contract between the orchestrator and the trainer, in one place: which policy version may
generate batch n (`policy_version`), and the other numbers both sides derive from run.async_level.

Imports no torch at module level: the control plane may import this module.
"""

from __future__ import annotations

# --- versions ---------------------------------------------------------------------------------------


def policy_version(step: int, async_level: int) -> int:
    """The policy version that generates batch `step`: exactly max(0, step - async_level).

    Exactly, not "the newest one available": which versions the trainer has published at any moment
    depends on timing, and batch n must be a function of the config, seed, n and the weights alone
    (a resumed run regenerates it). It is also the oldest version batch `step` may hold: continuous
    mode drops a group that started before it.
    """
    return max(0, step - async_level)


def past_versions(step: int, async_level: int) -> range:
    """The versions before `step` that batches `step`, `step` + 1, ... may still come from: the
    trainer at step `step` (holding version `step`) keeps these for recomputed behaviour logprobs."""
    return range(policy_version(step, async_level), step)


def weights_kept(async_level: int) -> int:
    """How many of the newest versions the trainer keeps on disk: version n, just written, and
    `past_versions(n)`, which batches n, n+1, ... still to be generated may need."""
    return async_level + 1


def versions_in_flight(async_level: int) -> int:
    """How many versions the weight broadcast may hold at once: the trainer exports n + 1 while the
    orchestrator may still need n - async_level for batch n."""
    return weights_kept(async_level) + 1
