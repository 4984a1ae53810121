"""Full trainer state for resume: `RUN/checkpoints/step_N/` (N = optimizer steps taken).

    step_N/trainer/          torch DCP: sharded model + optimizer, lr scheduler, progress
                             (step_0: no optimizer state; see _app_state); with
                             trainer.behaviour_logprobs recompute, the past versions it keeps
    step_N/trainer/rng_rank_R.pt   each rank's RNG streams
    step_N/data_order.json   the data order of the last batch consumed (prl.run.batch: the orchestrator
                             resumes from it); absent when none was (a step-0 checkpoint)
    step_N/COMPLETE          written last, by the trainer; without it the directory is ignored

The trainer state is written to `step_N/.trainer.tmp` and renamed, so a crash mid-save leaves
nothing that looks like a checkpoint. DCP stores shards per rank and reshards on load, so a run
may resume on a different number of ranks (RNG streams are then reseeded).
"""

from __future__ import annotations

import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from loguru import logger
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from prl.config import CheckpointConfig
from prl.run import fence, rundir
from prl.run.attempt import Attempt
from prl.run.batch import write_data_order
from prl.run.files import fsync
from prl.run.lora import is_adapter
from prl.run.protocol import CHECKPOINTS_DONE
from prl.run.rundir import RunDir, is_complete, mark_complete, remove_step, step_of
from prl.trainer.behaviour import BehaviourPolicy


def checkpoint_dir(rd: RunDir, step: int) -> Path:
    return rd.checkpoint_dir(step)


def complete_steps(rd: RunDir) -> list[int]:
    """Steps with a complete checkpoint, oldest first."""
    return rundir.complete_steps(rd.checkpoints)


def newest_complete(rd: RunDir) -> int | None:
    steps = complete_steps(rd)
    return steps[-1] if steps else None


def checkpoint_due(cfg: CheckpointConfig, step: int) -> bool:
    """Whether the loop checkpoints `step` on its way (trainer.checkpoint.interval); the run's end is one regardless."""
    return bool(cfg.interval) and step % cfg.interval == 0


def load_newest(rd: RunDir, model, optimizer, scheduler, behaviour: BehaviourPolicy | None) -> int:
    """The step to start at: the newest complete checkpoint's, loaded; 0 without one. (`prl resume
    --step N` starts a run at an older one by removing those after it: RunDir.rewind.)"""
    step = newest_complete(rd)
    if step is None:
        logger.info("no complete checkpoint: starting at step 0")
        return 0
    step = load_checkpoint(rd, step, model, optimizer, scheduler, behaviour)
    logger.info(f"resumed from checkpoint step {step}")
    return step


def rng_state() -> dict:
    """Every RNG stream of this rank in types torch.load(weights_only=True) reads back (numpy's key
    array as a tensor): loading a checkpoint never unpickles arbitrary objects."""
    name, keys, *rest = np.random.get_state()
    state = {"python": random.getstate(), "numpy": [name, torch.from_numpy(keys.astype(np.int64)), *rest],
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def load_rng_file(path: Path) -> dict:
    """A rank's RNG file, weights-only: no object other than tensors and plain values is built. Files
    written before numpy's state was kept as a tensor hold a numpy array: those types, and only
    those, are allowed too, so that such checkpoints still resume exactly."""
    numpy_array = [np._core.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    with torch.serialization.safe_globals(numpy_array):
        return torch.load(path, weights_only=True)


def _options(model, loading: bool = False) -> StateDictOptions:
    """With adapters (trainer.lora) a checkpoint holds what trains, not the frozen base, which every
    launch loads again from model.name: loading then sets the trained parameters alone (strict off)."""
    frozen = any(not p.requires_grad for p in model.parameters())
    return StateDictOptions(strict=not frozen) if loading else StateDictOptions(ignore_frozen_params=frozen)


def _app_state(model, optimizer, scheduler, step: int, behaviour: dict | None = None) -> dict:
    """What a checkpoint after `step` optimizer steps holds. Before the first step there is no
    optimizer state to keep, and asking for one changes the optimizer: get_state_dict initialises
    an empty one by stepping it once with zero gradients and lr 0, which leaves AdamW's step count
    at 1, so the resumed run's first update would use another bias correction. A step-0 checkpoint
    therefore holds no optimizer state, and loading it leaves the fresh optimizer untouched."""
    state = {"scheduler": scheduler.state_dict(), "progress": {"step": step}}
    if behaviour:  # prl.trainer.behaviour: {"v<N>": {name: tensor}}
        state["behaviour"] = behaviour
    if (flat := getattr(model, "flat", None)) is not None:  # trainer.flat_params: the same layout, views of its tensors
        return state | {"model": flat.model_state(model)} | ({"optim": flat.optim_state(optimizer)} if step else {})
    if step == 0:
        return state | {"model": _trained(model, get_model_state_dict(model, options=_options(model)))}
    model_state, optim_state = get_state_dict(model, optimizer, options=_options(model))
    return state | {"model": _trained(model, model_state), "optim": optim_state}


def _trained(model, model_state: dict) -> dict:
    """Without the frozen base's tensors: torch's ignore_frozen_params keeps a tied LM head (the
    frozen embedding's second name; 0.47 GB of a 1.5B Qwen2 adapter checkpoint)."""
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    if len(trained) == sum(1 for _ in model.parameters()):
        return model_state
    return {name: value for name, value in model_state.items() if name in trained}


def save_checkpoint(rd: RunDir, step: int, model, optimizer, scheduler, keep_last: int,
                    behaviour: BehaviourPolicy | None = None, data_order: dict | None = None) -> Path:
    """Collective: every rank writes its shards; rank 0 renames, adds `data_order` (that of the last
    batch consumed, prl.run.batch), marks complete and prunes; only while its attempt is the run's
    writer (prl.run.fence), checked before each change, and COMPLETE records that attempt."""
    final = checkpoint_dir(rd, step)
    tmp = final / ".trainer.tmp"
    what = f"checkpoint {final.name}"
    if is_complete(final):  # e.g. preempted right after resuming from this very step
        return final
    if dist.get_rank() == 0:
        fence.check(rd, what)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    # Fault injection for tests: widen the window in which a kill (or a full disk) meets an incomplete
    # checkpoint; before the writes, so that what a test does once .trainer.tmp exists comes first.
    time.sleep(fault_delay(step))
    dcp.save(_app_state(model, optimizer, scheduler, step, behaviour and behaviour.state()), checkpoint_id=tmp)
    # RNG streams differ per rank; DCP keeps one copy of non-tensor values, so they get files of their own.
    torch.save(rng_state(), rng_file := tmp / f"rng_rank_{dist.get_rank()}.pt")
    fsync(rng_file)  # by its writer, as DCP syncs its own files: on a shared filesystem rank 0 cannot
    dist.barrier()
    if dist.get_rank() == 0:
        fence.check(rd, what)
        shutil.rmtree(final / "trainer", ignore_errors=True)
        tmp.rename(final / "trainer")
        write_data_order(final, data_order)
        mark_complete(final, fence=lambda: fence.check(rd, f"COMPLETE of {what}"))
        if (attempt := Attempt.current()) is not None:
            with open(attempt.marker(CHECKPOINTS_DONE), "a") as f:
                f.write(f"step_{step}\n")
        prune_checkpoints(rd, keep_last)
    dist.barrier()
    return final


def fault_delay(step: int) -> float:
    """Test-only: PRL_FAULT_CHECKPOINT_DELAY_S=S holds every checkpoint write S seconds before it
    writes, S@N only step N's (the other checkpoints of a test's run then cost nothing extra)."""
    seconds, _, at = os.environ.get("PRL_FAULT_CHECKPOINT_DELAY_S", "0").partition("@")
    return float(seconds) if not at or int(at) == step else 0.0


def load_checkpoint(rd: RunDir, step: int, model, optimizer, scheduler,
                    behaviour: BehaviourPolicy | None = None) -> int:
    """Restore everything saved at `step` in place; returns the step (the next batch to consume)."""
    path = checkpoint_dir(rd, step) / "trainer"
    check_adapters(path, model)
    state = _app_state(model, optimizer, scheduler, step, behaviour and behaviour_to_load(path, step, behaviour))
    state["progress"]["step"] = -1  # read back from the checkpoint below
    dcp.load(state, checkpoint_id=path)
    if behaviour is not None:
        behaviour.loaded_from(state.get("behaviour", {}))
    if (flat := getattr(model, "flat", None)) is not None:
        flat.loaded(optimizer, state.get("optim"))  # DCP loaded into its views
    elif "optim" in state:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=_options(model, loading=True))
    else:
        set_model_state_dict(model, state["model"], options=_options(model, loading=True))
    scheduler.load_state_dict(state["scheduler"])
    rng_file = path / f"rng_rank_{dist.get_rank()}.pt"
    if rng_file.exists():
        set_rng_state(load_rng_file(rng_file))
    else:
        logger.warning(f"{rng_file} missing (world size changed?): RNG streams stay freshly seeded")
    return int(state["progress"]["step"])


def check_adapters(path: Path, model) -> None:
    """The checkpoint's adapters (trainer.lora) must be the model's, or both have none: a resume across
    a change of trainer.lora would otherwise fail inside DCP, or load adapters of another shape."""
    saved = {key.removeprefix("model."): meta.size for key, meta in
             dcp.FileSystemReader(path).read_metadata().state_dict_metadata.items()
             if key.startswith("model.") and is_adapter(key) and hasattr(meta, "size")}
    ours = {name: p.shape for name, p in model.named_parameters() if is_adapter(name)}
    if saved.keys() == ours.keys() and all(saved[k] == ours[k] for k in ours):
        return
    where = f"{path.parent.name} was trained with"
    if _rank(saved) != _rank(ours):
        raise ValueError(f"trainer.lora.rank: {where} rank {_rank(saved)} (0: no adapters), this run has rank "
                         f"{_rank(ours)}: resume with trainer.lora.rank={_rank(saved)}")
    modules = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in saved})
    raise ValueError(f"trainer.lora.target_modules: {where} adapters on {modules}, which this run's do not match")


def _rank(adapters: dict) -> int:
    """The rank of adapters by name -> shape (A is [rank, in]); 0 for none."""
    return next((size[0] for name, size in adapters.items() if ".lora_A." in name), 0)


def behaviour_to_load(path: Path, step: int, behaviour: BehaviourPolicy) -> dict:
    """Empty tensors for the past versions a resume at `step` needs, after checking the checkpoint has them."""
    versions = behaviour.held_at(step)
    saved = {key.split(".")[1] for key in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
             if key.startswith("behaviour.")}
    if missing := [v for v in versions if f"v{v}" not in saved]:
        raise ValueError(
            f"{path.parent.name} holds no weights of policy versions {missing}, which generated the batches from {step} "
            "on (saved with trainer.behaviour_logprobs=inference, or another run.async_level): set "
            "trainer.behaviour_logprobs=inference to resume from it")
    return behaviour.to_load(versions)


def prune_checkpoints(rd: RunDir, keep_last: int) -> None:
    """Keep the newest `keep_last` complete checkpoints; drop older ones (COMPLETE first: remove_step)
    and interrupted saves older than the newest (a save still in progress is newer than every
    complete one). Only by the run's current attempt (prl.run.fence)."""
    steps = complete_steps(rd)
    if not steps:
        return
    fence.check(rd, "pruning checkpoints")
    oldest_kept, newest = steps[-min(keep_last, len(steps))], steps[-1]
    for path in rd.checkpoints.glob("step_*"):
        step = step_of(path)
        if step is not None and (step < oldest_kept or (step < newest and not is_complete(path))):
            remove_step(path)
