"""What each `trainer.loss` option changes in a short run: the real trainer on the same fixed batch.

    python benchmarks/loss_options.py --model .cache/tiny-qwen2 --steps 6 --out /tmp/loss_options

One batch of rollouts is made once: random prompt and completion tokens with the model's own float32
logprobs of them as the inference logprobs (exactly on-policy for version 0), advantages -1, 0, 1. Every
step trains on that same batch, so at step n the policy is n updates away from the one that "sampled"
it (like async_level = n, or n PPO epochs): step 0 has all ratios at 1, later steps show what each
loss does with drifting ratios. Each option is one `torchrun jobs/trainer.py` run (gloo, CPU, one
rank) from the same initial weights and seed; printed per option and step: the loss, the fraction of
loss tokens clipped / masked / out of the ratio band, the KL term, the k3 mismatch KL; then the relative weight change after
the last step and the distance from the clip run's final weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from prl.run.batch import Batch, write_batch
from prl.run.rundir import RunDir
from prl.config import (
    CheckpointConfig, Config, EnvironmentConfig, LossConfig, ModelConfig, OrchestratorConfig, RunConfig, TrainerConfig,
    WandbConfig, to_yaml,
)
from prl.run.packing import Sample, pack_batch

REPO = Path(__file__).resolve().parents[1]
OPTIONS = {
    "clip": LossConfig(),
    "clip+kl1e-3": LossConfig(kl_tau=1e-3),
    "dppo": LossConfig(type="dppo"),
    "dppo+kl1e-3": LossConfig(type="dppo", kl_tau=1e-3),
    "custom": LossConfig(type="custom", custom="custom_loss:reinforce"),
    "clip+band0.5-2": LossConfig(ratio_mask_low=0.5, ratio_mask_high=2.0),
}
"""Name -> loss; dppo+kl1e-3 is prime-rl's default loss; custom is tests/custom_loss.py (REINFORCE);
clip+band0.5-2 masks the tokens whose ratio left [0.5, 2] (trainer.loss.ratio_mask_low/high)."""


def make_samples(model_dir: Path, n: int = 16, prompt: int = 8, completion: int = 24, seed: int = 0) -> list[Sample]:
    """`n` rollouts of random tokens with the model's own logprobs of them; advantages -1, 0, 1 in turn."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (n, prompt + completion), generator=gen)
    with torch.no_grad():
        logits = model(ids).logits.float()
    logprobs = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])[..., 0]
    samples = []
    for i in range(n):
        lp = [0.0] * prompt + logprobs[i, prompt - 1 :].tolist()
        samples.append(Sample(ids[i].tolist(), [False] * prompt + [True] * completion, lp, float(i % 3 - 1)))
    return samples


def write_run(root: Path, model_dir: Path, loss: LossConfig, samples: list[Sample], steps: int, lr: float) -> Path:
    cfg = Config(
        # async_level = steps: every step trains on the batch version 0 "sampled", up to steps - 1 versions
        # stale, which the trainer's batch check (prl.run.batch.read_batch) then accepts.
        run=RunConfig(name="run", output_dir=str(root), max_steps=steps, seed=3, async_level=steps,
                      wandb=WandbConfig(mode="disabled")),
        model=ModelConfig(name=str(model_dir), dtype="float32", max_model_len=512),
        trainer=TrainerConfig(gpus_per_node=0, lr=lr, loss=loss, checkpoint=CheckpointConfig(interval=0)),
        orchestrator=OrchestratorConfig(environment=EnvironmentConfig(id="prl.envs.toy"), batch_size=len(samples),
                                        rollouts_per_example=2),
    )
    run = root / "run"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(cfg))
    for step in range(steps):
        write_batch(RunDir(run), Batch(step=step, policy_version=0, micro_batches=pack_batch(samples, 1, 4), metrics={}))
    return run


def train(run: Path, timeout_s: float = 600) -> list[dict]:
    """`torchrun jobs/trainer.py` on one CPU rank; its per-step metrics. tests/ is on PYTHONPATH for
    the custom loss."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH")]))
    env = os.environ | {"PRL_RUN_DIR": str(run), "PRL_LOG_DIR": str(run / "logs/attempt_1"), "OMP_NUM_THREADS": "1",
                        "PYTHONPATH": pythonpath}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
           str(REPO / "jobs/trainer.py"), str(run / "config.yaml")]
    r = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"trainer failed ({r.returncode}):\n{(r.stdout + r.stderr)[-4000:]}")
    lines = (run / "logs/attempt_1/trainer/metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def weight_change(model_dir: Path, run: Path, steps: int, reference: Path | None = None) -> tuple[float, float | None]:
    """(||final - initial|| / ||initial||, ||final - reference final|| / ||initial||), over every weight."""
    initial = load_file(model_dir / "model.safetensors")
    final = load_file(run / f"weights/step_{steps}/model.safetensors")
    norm = torch.sqrt(sum(t.double().square().sum() for t in initial.values()))

    def dist(a, b):
        return float(torch.sqrt(sum((a[k].double() - b[k].double()).square().sum() for k in a)) / norm)

    ref = load_file(reference / f"weights/step_{steps}/model.safetensors") if reference else None
    return dist(final, initial), (dist(final, ref) if ref is not None else None)


def run_options(model_dir: Path, out: Path, names: list[str], steps: int, lr: float) -> dict[str, dict]:
    samples = make_samples(model_dir)
    results = {}
    for name in names:
        run = write_run(out / name, model_dir, OPTIONS[name], samples, steps, lr)
        results[name] = {"metrics": train(run), "run": run}
    reference = results.get("clip", {}).get("run")
    for result in results.values():
        result["weight_change"], result["vs_clip"] = weight_change(model_dir, result["run"], steps, reference)
    return results


def table(results: dict[str, dict]) -> str:
    cols = ("train/loss", "train/clip_fraction", "train/masked_fraction", "train/ratio_masked_fraction",
            "train/kl_term", "train/mismatch_kl")
    lines = ["| option | step | loss | clipped | masked | out of band | kl term | mismatch kl |",
             "|---|---|---|---|---|---|---|---|"]
    for name, result in results.items():
        for m in result["metrics"]:
            cells = [f"{m[c]:.4g}" if c in m else "-" for c in cols]
            lines.append(f"| {name} | {m['step']} | " + " | ".join(cells) + " |")
    lines += ["", "| option | weight change (rel.) | distance from clip's final weights (rel.) |", "|---|---|---|"]
    for name, result in results.items():
        vs = "-" if result["vs_clip"] is None else f"{result['vs_clip']:.3g}"
        lines.append(f"| {name} | {result['weight_change']:.3g} | {vs} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=REPO / ".cache/tiny-qwen2")
    parser.add_argument("--out", type=Path, required=True, help="a new directory for the runs")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--lr", type=float, default=3e-3, help="configs/toy.yaml's")
    parser.add_argument("--options", default=",".join(OPTIONS), help=f"comma-separated, of {', '.join(OPTIONS)}")
    args = parser.parse_args()
    results = run_options(args.model.resolve(), args.out.resolve(), args.options.split(","), args.steps, args.lr)
    print(table(results))


if __name__ == "__main__":
    main()
