"""Per-step metrics: one loguru line, one JSON line in `$PRL_LOG_DIR/trainer/metrics.jsonl`, and W&B.

Only rank 0 reports; every other rank (and W&B mode `disabled`) gets a `NullSink`, so the loop
calls `sink.log(...)` unconditionally.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import time
from pathlib import Path

from loguru import logger

from prl.config import Config
from prl.run.attempt import Attempt
from prl.run.rundir import RunDir


class NullSink:
    def log(self, metrics: dict[str, float], step: int) -> None:
        pass

    def finish(self) -> None:
        pass


def _public_config(cfg: Config) -> dict:
    """The whole resolved config, as W&B shows it; the values of every `env` mapping are hidden
    (tokens travel there), their names are kept."""
    def hide(node):
        if isinstance(node, dict):
            return {k: ({name: "<hidden>" for name in v} if k == "env" and isinstance(v, dict) else hide(v))
                    for k, v in node.items()}
        return [hide(v) for v in node] if isinstance(node, list) else node

    return hide(dataclasses.asdict(cfg))


COMPLETION_COLUMNS = ("step", "example_id", "group", "rollout", "prompt", "completion", "reward", "advantage",
                      "trained", "dropped", "error")


def _text(messages) -> str:
    """Chat messages (or a plain prompt string) as readable text for a table cell."""
    if not isinstance(messages, list):
        return "" if messages is None else str(messages)
    return "\n\n".join(f"[{m.get('role')}] {m.get('content')}" if isinstance(m, dict) else str(m) for m in messages)


def completion_rows(path: Path, count: int) -> list[list]:
    """`count` rollouts of a step's completions file as table rows; none if it is missing.

    One per stretch of len/count rollouts, at a shifting offset: spread over the groups and over
    the positions within them (so not always the first rollout of a group)."""
    if count == 0 or not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    stride = len(records) // count
    chosen = records if stride == 0 else [records[i * stride + i % stride] for i in range(count)]
    return [[_text(r.get(c)) if c in ("prompt", "completion") else r.get(c) for c in COMPLETION_COLUMNS] for r in chosen]


class WandbSink:
    """A W&B run in RUN/wandb whose id lives in RUN/wandb_id, so every attempt appends to the same run.

    Each step also logs a sample of what the model wrote (the orchestrator's completions file for
    the step, written before its batch) as the table `completions`."""

    def __init__(self, cfg: Config, rd: RunDir):
        import wandb

        self.rd, self.completions_per_step = rd, cfg.run.wandb.completions_per_step
        id_file = rd.path / "wandb_id"
        if not id_file.exists():
            id_file.write_text(secrets.token_hex(6) + "\n")  # W&B ids: [a-z0-9], <= 64 chars
        (rd.path / "wandb").mkdir(parents=True, exist_ok=True)
        w = cfg.run.wandb
        self.run = wandb.init(
            project=w.project,
            entity=w.entity,
            group=w.group,
            tags=list(w.tags) or None,
            name=cfg.run.name,
            id=id_file.read_text().strip(),
            resume="allow",
            dir=rd.path,
            mode=cfg.run.wandb.mode,
            config=_public_config(cfg),
        )

    def log(self, metrics: dict[str, float], step: int) -> None:
        import wandb

        rows = completion_rows(self.rd.completions_path(step), self.completions_per_step)
        table = {"completions": wandb.Table(columns=list(COMPLETION_COLUMNS), data=rows)} if rows else {}
        self.run.log(metrics | table, step=step)

    def finish(self) -> None:
        self.run.finish()


def make_sink(cfg: Config, rd: RunDir, rank: int) -> NullSink | WandbSink:
    if rank != 0 or cfg.run.wandb.mode == "disabled":
        return NullSink()
    return WandbSink(cfg, rd)


LOG_LINE = (("train/loss", "loss", ".4f"), ("rollout/reward_mean", "reward", ".4f"), ("sft/epoch", "epoch", ".2f"),
            ("train/entropy", "entropy", ".4f"), ("train/grad_norm", "grad_norm", ".4f"),
            ("train/mismatch_kl", "mismatch_kl", ".2e"), ("train/clip_fraction", "clip", ".3f"),
            ("train/masked_fraction", "masked", ".3f"), ("train/kl_term", "kl_term", ".2e"),
            ("train/ratio_masked_fraction", "out_of_band", ".3f"),
            ("perf/tokens_per_s", "tokens/s", ".0f"), ("train/lr", "lr", ".2e"), ("perf/wait_s", "wait", ".1f", "s"))
"""The trainer log's line per step: (metric, label, format[, unit]), in order, each where the step has it."""


class StepReporter:
    """What the loop calls once per step."""

    def __init__(self, cfg: Config, rd: RunDir, rank: int):
        self.rank = rank
        self.sink = make_sink(cfg, rd, rank)
        attempt = Attempt.current()
        self.jsonl = attempt.metrics if attempt is not None and rank == 0 else None

    def report(self, step: int, metrics: dict[str, float]) -> None:
        if self.rank != 0:
            return
        m = metrics
        # Each figure the step has: an RL step all of LOG_LINE (and what the configured loss reports,
        # trainer.loss: the clip's or the mask's fraction, the KL term), an SFT step no reward, entropy or KL.
        shown = (f"{label} {m[key]:{fmt}}{unit[0] if unit else ''}" for key, label, fmt, *unit in LOG_LINE if key in m)
        logger.info(" | ".join([f"step {step}", *shown]))
        if self.jsonl is not None:
            self.jsonl.parent.mkdir(parents=True, exist_ok=True)
            with self.jsonl.open("a") as f:
                # The wall time lets `prl status` say how long ago the last step ended (a stall).
                f.write(json.dumps({"step": step, "time": round(time.time(), 3), **metrics}) + "\n")
        self.sink.log(metrics, step)

    def finish(self) -> None:
        self.sink.finish()
