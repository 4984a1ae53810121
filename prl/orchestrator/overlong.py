"""Over-long completions of a training environment (`overlong` of its config entry): kept, masked or
penalised.

A turn that hit its max_tokens (the environment's, else orchestrator.sampling's) was cut, not finished;
its reward scores a fragment.
`mask` leaves such rollouts out of the batch (so out of the loss and of its token denominator, as
DAPO's overlong filtering masks them), while their rewards stay in their group's baseline: the
group's other answers are judged against what the model really produced. `penalty` is DAPO's soft
overlong punishment: a turn longer than max_tokens - buffer tokens loses a share of `penalty` growing
linearly to all of it at the limit, subtracted from the reward before advantages are computed (the
reward metrics stay the environment's own).
"""

from __future__ import annotations

from dataclasses import dataclass

from prl.config import Config, OverlongConfig


@dataclass(frozen=True)
class Overlong:
    """One environment's rule, with the length limit it applies to."""

    mode: str = "keep"
    buffer: int = 0
    penalty: float = 1.0
    max_tokens: int = 0

    @classmethod
    def of(cls, cfg: OverlongConfig, max_tokens: int) -> Overlong:
        return cls(cfg.mode, cfg.buffer, cfg.penalty, max_tokens)

    def masks(self, output: dict) -> bool:
        """Whether the rollout is left out of the loss: mode mask and a turn cut at the limit."""
        return self.mode == "mask" and bool(output.get("is_truncated"))

    def reward_penalty(self, output: dict) -> float:
        """What mode penalty takes from the reward: 0 up to max_tokens - buffer tokens in a turn, then
        linearly up to `penalty` at max_tokens."""
        if self.mode != "penalty":
            return 0.0
        over = longest_turn(output) - (self.max_tokens - self.buffer)
        return self.penalty * min(1.0, max(0, over) / self.buffer)


def longest_turn(output: dict) -> int:
    """Tokens of the rollout's longest sampled turn (max_tokens limits each turn)."""
    turns = [len((turn.get("tokens") or {}).get("completion_ids") or []) for turn in output.get("trajectory") or []]
    return max(turns, default=0)


def train_rules(cfg: Config) -> list[Overlong]:
    """Each training environment's rule, in orchestrator.train_environments order."""
    orch = cfg.orchestrator
    return [Overlong.of(env.overlong, orch.max_tokens_of(env)) for env in orch.train_environments]
