"""Inference job: one vLLM OpenAI-compatible server on this node, with POST /update_weights.

    python jobs/inference.py RUN/config.yaml                                  # from the batch script
    python jobs/inference.py CONFIG.yaml model.dtype=float32 inference.port=8011   # local testing

Reads PRL_NODE_RANK (log file rank_R.log) and the variable named by inference.api_key_env, if set.
With inference.replica_servers and several replicas a node, it starts one such server per replica
(prl.inference.replicas), each on its own GPUs and port, logging to rank_<node x replicas + replica>.log.
With a `teacher` section it starts the teacher's server beside the policy's (the same program with
PRL_TEACHER set, serving teacher.model on teacher.port; prl.inference.teacher).
With run.mode=probe it only logs the vLLM command line and exits.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys

from loguru import logger

from prl.config import load_config
from prl.inference import replicas
from prl.inference.teacher import is_teacher, teacher_config
from prl.inference.server import serve, vllm_args
from prl.run import protocol
from prl.run.log import setup_logging


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cfg = load_config(argv[0], argv[1:])
    node = int(os.environ.get(protocol.NODE_RANK_ENV, "0"))
    if (len(cfg.inference.ports) > 1 or cfg.teacher is not None) and protocol.REPLICA_ENV not in os.environ:
        return replicas.run(argv, cfg)  # inference.replica_servers, a teacher: one of these per server
    if is_teacher():
        cfg = teacher_config(cfg)
    index = replicas.replica()
    setup_logging("inference", rank=replicas.log_rank())
    servers, gpus = len(cfg.inference.ports), os.environ.get("CUDA_VISIBLE_DEVICES")
    logger.info(f"{'teacher' if is_teacher() else 'inference'} node {node} on {socket.gethostname()}, port {cfg.inference.ports[index]}"
                + (f" (server {index} of the node's {servers})" if servers > 1 else "")
                + (f", CUDA_VISIBLE_DEVICES={gpus}" if gpus is not None and cfg.inference.gpus_per_node else ""))
    if cfg.run.mode == "probe":
        logger.info(f"probe: would run vllm serve {shlex.join(vllm_args(cfg))}")
        return 0
    serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
