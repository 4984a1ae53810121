"""rl_bench's run configs: what `prl submit --local` gets for each run of the loop benchmark, and the
--runs specs that name them (rl_bench.py runs them; rl_bench_engine.py and rl_bench_tables.py are its
other two parts).
"""

from __future__ import annotations

import argparse
import hashlib
import re
from pathlib import Path

import yaml

from prl.config.validate import MAX_NAME
from rl_bench_engine import stop_ids
from rl_bench_tables import replicas


def inference_memory(args: argparse.Namespace) -> dict:
    """vLLM's memory settings: a fraction of its own GPU, or a fixed KV cache on a shared one."""
    if args.gpus > 1:
        return {"gpu_memory_utilization": 0.85, "extra_args": []}
    kv_bytes = str(int(args.kv_cache_gib * 2**30))
    return {"gpu_memory_utilization": 0.4, "extra_args": ["--kv-cache-memory-bytes", kv_bytes]}


def run_name(level: int, route: str, behaviour: str, overrides: tuple[str, ...] = ()) -> str:
    """The run's name from its settings; a long one is cut and told apart by a digest of the whole
    (run.name takes at most MAX_NAME characters)."""
    name = f"async{level}-{route}" + ("" if behaviour == "inference" else f"-{behaviour}")
    name = "-".join([name, *(o.split("=")[0].rsplit(".", 1)[-1] + "_" + o.split("=", 1)[1] for o in overrides)])
    name = re.sub(r"[][*?]", "_", name)  # a list value's brackets: prl refuses a run directory vLLM would glob
    if len(name) <= MAX_NAME:
        return name
    return f"{name[:MAX_NAME - 9]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def parse_runs(text: str) -> list[tuple[int, str, str, tuple[str, ...]]]:
    """--runs: LEVEL:BEHAVIOUR[:ROUTE[:KEY=VALUE...]],... -> (level, route, behaviour, overrides)."""
    runs = []
    for spec in text.split(","):
        level, behaviour, *rest = spec.split(":")
        runs.append((int(level), rest[0] if rest and rest[0] else "tokens", behaviour, tuple(rest[1:])))
    return runs


def set_key(config: dict, override: str) -> None:
    """KEY=VALUE (dotted KEY, VALUE parsed as YAML) into the run config."""
    key, value = override.split("=", 1)
    *parents, last = key.split(".")
    for part in parents:
        config = config.setdefault(part, {})
    config[last] = yaml.safe_load(value)


def bench_config(args: argparse.Namespace, model: Path, level: int, route: str = "tokens",
                 behaviour: str = "inference", overrides: tuple[str, ...] = ()) -> dict:
    """The run config: GPUs, fixed-length completions, compile on, no periodic checkpoints; then `overrides`."""
    config = {
        "run": {"name": run_name(level, route, behaviour, overrides), "output_dir": str(args.work / "runs"), "max_steps": args.steps,
                "async_level": level, "wandb": {"mode": "disabled"}},
        "model": {"name": str(model), "dtype": "bfloat16", "max_model_len": args.completion_tokens + 512},
        "inference": {"gpus_per_node": replicas(args), "data_parallel": replicas(args), "port": args.port + level,
                      **inference_memory(args)},
        "trainer": {"gpus_per_node": args.trainer_gpus, "lr": 1e-6, "micro_batch_size": args.micro_batch,
                    "compile": True,
                    "behaviour_logprobs": behaviour,
                    "checkpoint": {"interval": 0, "keep_last": 1}},
        "orchestrator": {
            "placement": "trainer_node", "batch_size": args.batch_size, "rollouts_per_example": 8,
            "max_concurrent": args.batch_size, "environment": {"id": "prl.envs.toy"}, "rollout_route": route,
            "sampling": {"temperature": 1.0, "max_tokens": args.completion_tokens,
                         "extra_body": {"ignore_eos": True, "stop_token_ids": stop_ids(args.stop_tokens)}},
        },
    }
    for override in overrides:
        set_key(config, override)
    return config
