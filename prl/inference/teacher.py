"""The teacher's server: the inference program itself (jobs/inference.py), run with PRL_TEACHER set,
on a config whose policy model and server layout are replaced by the teacher's.

    PRL_TEACHER=1 python jobs/inference.py RUN/config.yaml   # what prl.inference.replicas starts per node

Same server, middleware and key as the policy's (prl.inference.server, routes): only the model, the
port, one replica a node, the GPU share and the extra arguments differ. It never loads a policy
version: /update_weights refuses (prl.inference.routes). Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import dataclasses
import os

from prl.config import Config, without_teacher
from prl.run import protocol


def is_teacher(environ: dict[str, str] | os._Environ = os.environ) -> bool:
    """This process serves the teacher (prl.inference.replicas set PRL_TEACHER for it)."""
    return bool(environ.get(protocol.TEACHER_ENV))


def teacher_config(cfg: Config) -> Config:
    """`cfg` as the teacher's server reads it: the teacher's model and port, one server a node on the
    node's first GPU (gpus_per_node 1) or its CPU cores (one rank: no expert parallelism), the policy's
    tool parser and extra arguments replaced by the teacher's; no `teacher` section of its own. One more
    token of context than the student: the teacher scores a whole sample (prompt + completion, up to
    model.max_model_len) as a prompt and samples one token after it."""
    teacher = cfg.teacher
    model = dataclasses.replace(cfg.model, name=teacher.model, max_model_len=cfg.model.max_model_len + 1)
    inference = dataclasses.replace(
        cfg.inference, port=teacher.port, gpus_per_node=min(cfg.inference.gpus_per_node, 1), tensor_parallel=1,
        servers_per_gpu=1, data_parallel=None, replica_servers=None, gpu_memory_utilization=teacher.gpu_memory_utilization,
        tool_call_parser=None, extra_args=list(teacher.extra_args), weight_transfer="filesystem",
        expert_parallel=False)
    # The teacher's own server has no teacher: the checks of one (its port, the loss's coefficient) are the policy's.
    cfg = without_teacher(cfg)
    trainer = dataclasses.replace(cfg.trainer, routing_replay=False)  # the policy's experts, not the teacher's
    return dataclasses.replace(cfg, model=model, inference=inference, trainer=trainer)

