"""Inference job: one vLLM OpenAI-compatible server on this node, with POST /update_weights.

    python jobs/inference.py RUN/config.yaml                                  # from the batch script
    python jobs/inference.py CONFIG.yaml model.dtype=float32 inference.port=8011   # local testing

Reads PRL_NODE_RANK (log file rank_R.log) and the variable named by inference.api_key_env, if set.
With run.mode=probe it only logs the vLLM command line and exits.
"""

from __future__ import annotations

import os
import shlex
import socket
import sys

from loguru import logger

from prl.config import load_config
from prl.inference.server import serve, vllm_args
from prl.run import protocol
from prl.run.log import setup_logging


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    cfg = load_config(argv[0], argv[1:])
    rank = int(os.environ.get(protocol.NODE_RANK_ENV, "0"))
    setup_logging("inference", rank=rank)
    logger.info(f"inference node {rank} on {socket.gethostname()}, port {cfg.inference.port}")
    if cfg.run.mode == "probe":
        logger.info(f"probe: would run vllm serve {shlex.join(vllm_args(cfg))}")
        return 0
    serve(cfg)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
