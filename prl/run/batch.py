"""The batch contract between the orchestrator and the trainer, in one place.

Batch n is `RUN/rollouts/step_n.pt`: the orchestrator writes it (`write_batch`, the only writer), every
trainer rank reads it (`read_batch`, the only reader, which checks it), and training step n turns it
into policy version n+1. Which version may generate batch n is `policy_version`; the other numbers
both sides derive from run.async_level are next to it. The format is `Batch`; on disk a `torch.save`
of its fields as a dict of tensors, numbers, strings and lists, so the trainer reads it with
`weights_only=True` and never unpickles code (docs/architecture.md, "Batch file format").

A batch also carries the orchestrator's data order after it (`Batch.data_order`: step, samples seen,
data position, and a fingerprint of what decides the order). The trainer keeps the latest it consumed
and writes it into its own checkpoint (`write_data_order`, `checkpoints/step_N/data_order.json`,
before COMPLETE); a resumed orchestrator reads it from there (`read_data_order`) and warns when the
data order changed. Nothing but the trainer writes into a checkpoint directory.

Imports no torch at module level: the control plane may import this module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path

from prl.run.files import write_atomic
from prl.run.rundir import RunDir

# --- versions ---------------------------------------------------------------------------------------


def policy_version(step: int, async_level: int) -> int:
    """The policy version that generates batch `step`: exactly max(0, step - async_level).

    Exactly, not "the newest one available": which versions the trainer has published at any moment
    depends on timing, and batch n must be a function of the config, seed, n and the weights alone
    (a resumed run regenerates it). It is also the oldest version batch `step` may hold: continuous
    mode drops a group that started before it, and `read_batch` refuses a batch from an older one.
    """
    return max(0, step - async_level)


def past_versions(step: int, async_level: int) -> range:
    """The versions before `step` that batches `step`, `step` + 1, ... may still come from: the
    trainer at step `step` (holding version `step`) keeps these for recomputed behaviour logprobs."""
    return range(policy_version(step, async_level), step)


def weights_kept(async_level: int) -> int:
    """How many of the newest versions the trainer keeps on disk: version n, just written, and
    `past_versions(n)`, which batches n, n+1, ... still to be generated may need."""
    return async_level + 1


def versions_in_flight(async_level: int) -> int:
    """How many versions the weight broadcast may hold at once: the trainer exports n + 1 while the
    orchestrator may still need n - async_level for batch n."""
    return weights_kept(async_level) + 1


# --- the format -------------------------------------------------------------------------------------

MICRO_BATCH_KEYS = ("input_ids", "position_ids", "loss_mask", "advantages", "inference_logprobs")
"""The tensors of every micro-batch, each [1, T] (a micro-batch also says its `num_samples`)."""


@dataclass(kw_only=True)
class Batch:
    """What the trainer's step `step` consumes (docs/architecture.md, "Batch file format")."""

    step: int
    """The trainer step that consumes it; the file is rollouts/step_{step}.pt."""
    policy_version: int
    """The version the servers held while generating it: policy_version(step, async_level), a newer
    stand-in for one that is gone (prl.orchestrator.resume.stand_in_version), or in continuous mode
    the oldest version a group of it started at; never older than policy_version, never above step."""
    micro_batches: list[list[dict]]
    """Per trainer rank, its micro-batches (MICRO_BATCH_KEYS tensors and num_samples), the same
    number on every rank: FSDP's collectives pair up forward and backward passes across ranks."""
    metrics: dict[str, float]
    """The orchestrator's metrics of the batch; the trainer logs them under rollout/ (env/ and eval/
    keys as they are)."""
    data_order: dict | None = None
    """The orchestrator's data order after this batch, i.e. before batch step + 1 (its "step" is
    step + 1): JSON, kept by the trainer in checkpoint step + 1 (module docstring). None in batches
    not made by the orchestrator (tests, benchmarks)."""


FIELDS = tuple(f.name for f in fields(Batch))


def batch_path(rd: RunDir, step: int) -> Path:
    return rd.rollout_path(step)


def write_batch(rd: RunDir, batch: Batch) -> Path:
    """rollouts/step_N.pt, written under a temporary name and renamed: a file that exists is whole."""
    import torch

    try:  # the trainer writes it into a JSON file: it fails here, in the orchestrator, if it cannot
        data_order = None if batch.data_order is None else json.loads(json.dumps(batch.data_order))
    except (TypeError, ValueError) as e:
        raise ValueError(f"batch {batch.step}: data_order is not JSON ({e})") from e
    content = {name: getattr(batch, name) for name in FIELDS} | {"data_order": data_order}
    return write_atomic(batch_path(rd, batch.step), lambda tmp: torch.save(content, tmp), hidden=False)


def read_batch(rd: RunDir, step: int, world_size: int | None = None, async_level: int | None = None) -> Batch:
    """Batch `step`, checked against the contract (a wrong file fails here, with what is wrong, not
    mid-backward); `world_size` and `async_level`, when given, are checked too."""
    import torch

    path = batch_path(rd, step)
    try:  # weights_only: the file holds tensors, numbers and strings only; never unpickle code.
        content = torch.load(path, map_location="cpu", weights_only=True)
    except OSError:  # missing or unreadable: not a question of format
        raise
    except Exception as e:
        raise ValueError(f"{path}: not a batch file ({type(e).__name__}: {e})") from e
    if problem := format_problem(content, step, world_size, async_level):
        raise ValueError(f"{path}: {problem}")
    return Batch(**content)


def format_problem(content, step: int, world_size: int | None, async_level: int | None) -> str | None:
    """What makes `content` (a batch file's) not batch `step`, or None."""
    if not isinstance(content, dict):
        return f"holds a {type(content).__name__}, not a batch (a dict with keys {list(FIELDS)})"
    if missing := [key for key in FIELDS if key not in content]:
        return f"batch without {missing}"
    if unknown := sorted(set(content) - set(FIELDS)):
        return f"unknown keys {unknown} (written by another prl version?)"
    if content["step"] != step:
        return f"holds step {content['step']}, expected {step}"
    return (version_problem(step, content["policy_version"], async_level)
            or micro_batch_problem(content["micro_batches"], world_size)
            or data_order_problem(step, content["data_order"])
            or (None if isinstance(content["metrics"], dict) else "metrics is not a dict"))


def version_problem(step: int, version, async_level: int | None) -> str | None:
    if not isinstance(version, int) or isinstance(version, bool):
        return f"policy_version {version!r} is not an integer"
    oldest = 0 if async_level is None else policy_version(step, async_level)
    if not oldest <= version <= step:
        return (f"generated by policy version {version}, but batch {step} may come only from versions "
                f"{oldest}..{step}" + ("" if async_level is None else f" (run.async_level {async_level})"))
    return None


def micro_batch_problem(per_rank, world_size: int | None) -> str | None:
    if not isinstance(per_rank, list) or not all(isinstance(mbs, list) for mbs in per_rank):
        return "micro_batches is not a list (per rank) of lists"
    if world_size is not None and len(per_rank) != world_size:
        return f"micro-batches for {len(per_rank)} ranks, the trainer has {world_size}"
    if len({len(mbs) for mbs in per_rank}) > 1:
        # Every rank must run the same number of forward/backward passes: FSDP's collectives pair up.
        return f"ranks have different numbers of micro-batches {[len(m) for m in per_rank]}"
    for mbs in per_rank:
        for mb in mbs:
            if not isinstance(mb, dict):
                return f"a micro-batch is a {type(mb).__name__}, not a dict"
            if missing := [key for key in MICRO_BATCH_KEYS if key not in mb]:
                return f"micro-batch without {missing}"
    return None


def data_order_problem(step: int, data_order) -> str | None:
    if data_order is None:
        return None
    if not isinstance(data_order, dict) or data_order.get("step") != step + 1:
        got = data_order.get("step") if isinstance(data_order, dict) else type(data_order).__name__
        return f"data_order must be the data order before step {step + 1} (a dict with that step), got {got!r}"
    return None


# --- the data order, kept by the trainer's checkpoint -------------------------------------------------

DATA_ORDER = "data_order.json"
"""In checkpoints/step_N, written by trainer rank 0 before COMPLETE: the data order of the last batch
the trainer consumed (Batch.data_order, whose step is N)."""
LEGACY_DATA_ORDER = "orchestrator.json"
"""The same, as orchestrators before prl.run.batch wrote it into the trainer's checkpoints; still read."""


def write_data_order(checkpoint_dir: Path, data_order: dict | None) -> None:
    """The trainer's: `data_order` into its checkpoint directory, still without COMPLETE (None: a
    checkpoint before any batch of the run was consumed, which records none)."""
    path = Path(checkpoint_dir) / DATA_ORDER
    if data_order is None:
        path.unlink(missing_ok=True)  # left by an interrupted save of the same step
    else:
        write_atomic(path, json.dumps(data_order, indent=2) + "\n")


def read_data_order(rd: RunDir, step: int) -> dict | None:
    """The data order checkpoint `step` keeps (its "step" is `step`), or None if it keeps none."""
    directory = rd.checkpoint_dir(step)
    for name in (DATA_ORDER, LEGACY_DATA_ORDER):
        if (directory / name).is_file():
            return json.loads((directory / name).read_text())
    return None
