"""Multi-turn rollouts kept and dropped, per rollout route, on one real vLLM server.

    python benchmarks/multiturn_drops.py --model .cache/tiny-qwen2 --steps 3     # CPU: ~3 minutes

Starts `jobs/inference.py` (CPU build when there is no GPU; stopped by PID at the end), then runs
the orchestrator's own `generate_step` on the guess_letter environment (up to 3 turns) for --steps
batches through each route of `orchestrator.rollout_route`, the same seeds and prompts for both, and
prints per step: rollouts, samples kept, dropped fraction (by reason), errored fraction, mean turns.
"""

from __future__ import annotations

import argparse
import asyncio
import platform
import tempfile
from pathlib import Path

import yaml

from prl.config import EnvironmentConfig, SamplingConfig
from prl.inference.standalone import start_server
from prl.orchestrator.client import Servers
from prl.orchestrator.dataset import EnvGroups, example_indices, load_env, rollout_groups
from prl.orchestrator.rollouts import generate_step, sampling_args


async def run_route(url: str, key: str, model: Path, route: str, args: argparse.Namespace) -> list[dict]:
    env = load_env(EnvironmentConfig(id="prl.envs.guess_letter", args={"max_turns": args.max_turns}))
    dataset = env.get_dataset()
    servers = Servers([f"{url}/v1"], key, tokenizer=str(model) if route == "tokens" else None)
    try:
        served = await servers.model_name()
        sampling = sampling_args(SamplingConfig(max_tokens=args.max_tokens), env)
        steps = []
        for step in range(args.steps):
            indices = example_indices(0, step, args.prompts, len(dataset))
            groups = rollout_groups(dataset, indices, args.group, 0, step)
            parts = [EnvGroups("guess_letter", env, groups, sampling)]
            result = await generate_step(parts, servers, served, 32, filter_zero_advantage=False)
            steps.append(result.metrics)
        return steps
    finally:
        await servers.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=4)
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    model = args.model.resolve()
    with tempfile.TemporaryDirectory() as work:
        config = Path(work) / "config.yaml"
        config.write_text(yaml.safe_dump({
            "run": {"name": "drops", "output_dir": work},
            "model": {"name": str(model), "dtype": "float32", "max_model_len": 512},
            "inference": {"gpus_per_node": 0, "enforce_eager": True, "env": {"VLLM_CPU_KVCACHE_SPACE": "1"}},
            "trainer": {"gpus_per_node": 0},
            "orchestrator": {"environment": {"id": "prl.envs.guess_letter"}},
        }))
        server = start_server(config, output=Path(work) / "server.out")
        try:
            server.wait_healthy(timeout_s=600)
            results = {route: asyncio.run(run_route(server.url, server.key, model, route, args)) for route in ("chat", "tokens")}
        finally:
            server.stop()
    print(f"machine: {platform.node()}, {platform.processor() or platform.machine()}; model {model.name}; "
          f"guess_letter, up to {args.max_turns} turns of {args.max_tokens} tokens; {args.prompts} x {args.group} rollouts per step")
    print("| route | step | rollouts | kept | dropped | dropped by reason | errored | mean turns |")
    print("| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
    for route, steps in results.items():
        for step, m in enumerate(steps):
            reasons = ", ".join(f"{k.split('/', 1)[1]} {v:.0f}" for k, v in sorted(m.items()) if k.startswith("dropped/") and v)
            print(f"| {route} | {step} | {m['rollouts']:.0f} | {m['samples']:.0f} | {m['dropped_frac']:.1%} | {reasons or '-'} "
                  f"| {m['error_frac']:.1%} | {m.get('metric/num_turns', float('nan')):.2f} |")


if __name__ == "__main__":
    main()
