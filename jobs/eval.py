"""Eval of one saved policy version: its own vLLM server, the run's eval settings, RUN/evals/step_N.json.

    python jobs/eval.py RUN/config.yaml STEP      # what `prl eval` runs, locally or per SLURM array task

Serves weights/step_STEP (version 0: model.name) with one inference node's settings of the run's
config, runs `orchestrator.eval` (environments, examples, rollouts, sampling) against it, writes the
record and stops the server. Logs under RUN/evals/logs/step_STEP/. Exit 2 when the step has no
complete weights, 1 when the server or the eval fails.
"""

import argparse
import asyncio
import dataclasses
import os
import sys

from prl.config import Config, load_config, to_yaml, without_teacher
from prl.run import lora
from prl.run.rundir import RunDir, is_complete


def serving_config(cfg: Config, weights: str) -> Config:
    """The run's config serving `weights` on one node: one server (the eval has one URL) with vLLM's data
    parallelism over the node's GPUs, even where the run gives each replica a server (replica_servers)
    or several a GPU (servers_per_gpu), or one server over several nodes (multi_node=data_parallel); on
    CPU one replica. The replicas are derived again from that layout. The run's expert parallelism where
    that server has more than one GPU (with one, vLLM has nothing to spread the experts over).
    No teacher (on-policy distillation's): an eval scores the policy alone."""
    one_node = dataclasses.replace(cfg.inference, nodes=1, multi_node="servers", servers_per_gpu=1, data_parallel=None,
                                   replica_servers=False, expert_parallel=False)
    expert_parallel = cfg.inference.expert_parallel and one_node.engine_ranks() > 1
    inference = dataclasses.replace(one_node, expert_parallel=expert_parallel)
    return dataclasses.replace(without_teacher(cfg), model=dataclasses.replace(cfg.model, name=weights), inference=inference)


def main(config_path: str, step: int) -> int:
    cfg = load_config(config_path)
    rd = RunDir.of(cfg)
    if step != 0 and not is_complete(rd.weights_dir(step)):
        print(f"eval: {rd.weights_dir(step)} is not complete (or was pruned); nothing to evaluate", file=sys.stderr)
        return 2
    weights = cfg.model.name if step == 0 else str(rd.weights_dir(step))
    # An adapter version (trainer.lora) is served as the training servers serve it: the base model,
    # then the version loaded into it (folded in; prl.run.lora).
    adapter = step != 0 and lora.is_adapter_version(rd.weights_dir(step))
    log_dir = rd.eval_log_dir(step)
    log_dir.mkdir(parents=True, exist_ok=True)
    os.environ["PRL_LOG_DIR"] = str(log_dir)
    # A config file rather than a model.name=... override: a path is never parsed as YAML.
    serving = log_dir / "config.yaml"
    serving.write_text(to_yaml(serving_config(cfg, cfg.model.name if adapter else weights)))

    from loguru import logger

    from prl.inference.standalone import start_server
    from prl.run.log import setup_logging

    setup_logging("eval")
    logger.info(f"eval of policy version {step} ({weights}); vLLM log: {log_dir / 'server.out'}")
    server = start_server(serving, output=log_dir / "server.out", log_dir=log_dir)
    try:
        server.wait_healthy(timeout_s=cfg.watchdog.ready_timeout_s)
        from prl.orchestrator.evals import evaluate_saved

        record = asyncio.run(evaluate_saved(cfg, rd, step, weights, f"{server.url}/v1", load=adapter))
    finally:
        server.stop()
    print(f"step {step}: reward {record['reward_mean']:.4f} over {record['rollouts']} rollouts -> {rd.eval_path(step)}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the run's RUN/config.yaml")
    parser.add_argument("step", type=int, help="policy version: weights/step_STEP (0: model.name)")
    args = parser.parse_args()
    sys.exit(main(args.config, args.step))
