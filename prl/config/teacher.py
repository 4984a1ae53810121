"""The `teacher` section: on-policy distillation's teacher model, served by vLLM servers of its own
(docs/distillation.md). Its logprobs of the student's sampled tokens travel in the batch
(`teacher_logprobs`); the trainer's loss pulls the student towards it by `trainer.loss.teacher_kl_coef`."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from prl.config.common import _check, _one_of, _positive, _single_line

PLACEMENTS = ("inference_nodes",)
"""Where the teacher's servers run: beside the policy's, one on every inference node."""


@dataclass(kw_only=True)
class TeacherConfig:
    model: str
    """HF model id or local directory of the teacher (an SFT or RL run's `weights/step_N`); its
    tokenizer must give the student's tokens the same ids (checked at submit)."""
    placement: str = "inference_nodes"
    """inference_nodes: one teacher server on every inference node, beside the policy's servers, in
    the inference component (started, watched and ended with them)."""
    port: int = 8100
    """HTTP port of each teacher server (not one of the policy servers' ports)."""
    gpu_memory_utilization: float = 0.3
    """Fraction of the node's first inference GPU the teacher takes (vLLM's --gpu-memory-utilization);
    with inference.gpu_memory_utilization it must leave the GPU whole (sum <= 1)."""
    extra_args: list[str] = field(default_factory=list)
    """Extra vLLM server arguments of the teacher's servers, passed as given."""
    max_concurrent: int = 64
    """Teacher requests (one per sample) in flight at once, over all its servers."""

    def __post_init__(self) -> None:
        _check(bool(self.model), "teacher.model", "must be set")
        _single_line(self.model, "teacher.model")
        _one_of(self.placement, PLACEMENTS, "teacher.placement")
        _check(0 < self.port < 65536, "teacher.port", f"must be a TCP port, got {self.port}")
        _check(0 < self.gpu_memory_utilization <= 1, "teacher.gpu_memory_utilization", "must be in (0, 1]")
        _positive(self.max_concurrent, "teacher.max_concurrent")
        for i, arg in enumerate(self.extra_args):
            _check(re.search(r"[\n\0]", arg) is None, f"teacher.extra_args[{i}]", "must be a single line")
