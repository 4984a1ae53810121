"""The trainer loop: batch n from the orchestrator in, policy version n+1 out.

    torchrun --nproc-per-node 8 jobs/trainer.py RUN/config.yaml [--resume-step N]

Reads RUN/rollouts/step_N.pt, writes RUN/weights/step_{N+1}/ and RUN/checkpoints/step_N/
(docs/architecture.md). SIGUSR1/SIGTERM or `$PRL_LOG_DIR/stop_requested`: checkpoint at the next step
boundary, write $PRL_LOG_DIR/preempted, exit 42 (torchrun itself then exits 1: the job script keys on
the file). Deadlines (prl.run.watchdog): rendezvous, model load and resume within watchdog.ready_timeout_s;
each next batch and step within the stall window, else `$PRL_LOG_DIR/stalled` and exit 16.

Test-only fault injection: PRL_FAULT_HANG_AT_STEP=N hangs rank 0 at the start of step N;
PRL_FAULT_CHECKPOINT_DELAY_S (prl.trainer.ckpt) slows every checkpoint write.
"""

from __future__ import annotations

import functools
import os
import random
import threading
import time
import warnings
from datetime import timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from loguru import logger

from prl.config import Config, TrainerConfig
from prl.run import broadcast as bc
from prl.run.attempt import LOG_DIR_ENV, Attempt
from prl.run.batch import (Batch, batch_path, last_policy_version, read_batch, read_data_order, versions_in_flight,
                           weights_kept)
from prl.run.log import setup_logging
from prl.run.protocol import WEIGHTS_BACKEND_ENV, PREEMPTED, RANK_EXIT_PREEMPTED as PREEMPTED_EXIT_CODE
from prl.run.rundir import RunDir, is_complete
from prl.run.watchdog import Watchdog
from prl.trainer.behaviour import BehaviourPolicy
from prl.trainer.broadcast_sender import Sender
from prl.trainer.ckpt import checkpoint_dir, load_checkpoint, newest_complete, save_checkpoint
from prl.trainer.export import (BackgroundWriter, adapter_of, make_durable, model_source_dir, pin_staging_ahead,
                               prune_weights, save_weights, weights_dir)
from prl.trainer.loss import PolicyLoss, build_loss
from prl.trainer.metrics import StepReporter
from prl.trainer.model import build_model
from prl.trainer.prewarm import micro_batch_lengths, prewarm
from prl.trainer.samples import count_tokens, to_device
from prl.trainer.stop import StopFlag, ignore as ignore_stop_signals


def init_distributed(cfg: TrainerConfig, timeout_s: float) -> torch.device:
    """NCCL on GPUs, gloo on CPU; torchrun provides RANK/WORLD_SIZE/LOCAL_RANK/MASTER_*.

    `timeout_s` bounds the rendezvous and every collective (the watchdog's stall window usually
    fires first for a collective that hangs)."""
    timeout = timedelta(seconds=timeout_s)
    if cfg.gpus_per_node > 0 and torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return device


def seed_everything(seed: int, device: torch.device, deterministic: bool | None) -> None:
    """Same seed on every rank: all ranks initialise identically; exact resume needs determinism too
    (trainer.deterministic; None: on CPU only)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if deterministic if deterministic is not None else device.type == "cpu":
        # cuBLAS reads this when its first handle is made (the first matmul, after this).
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig, device: torch.device):
    # With adapters (trainer.lora) only they train: no optimizer state for the frozen base.
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type == "cuda")
    warmup = cfg.warmup_steps
    # Linear warm-up from lr/warmup at the first step to lr, then constant.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler


def all_reduce(values: list[float], device: torch.device, op=dist.ReduceOp.SUM) -> list[float]:
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(tensor, op=op)
    return tensor.tolist()


def wait_for_batch(rd: RunDir, step: int, async_level: int, stop: StopFlag, device: torch.device,
                   poll_s: float) -> Batch | None:
    """The batch for `step` once every rank sees it (checked: prl.run.batch.read_batch); None if any rank
    was asked to stop first.

    The ranks decide together each poll (one tiny all-reduce, every `poll_s`): if one rank saw a signal
    and the others did not, they must still all take the same branch, or the next collective hangs.
    """
    path = batch_path(rd, step)
    last_note = time.monotonic()
    while True:
        missing, stopping = all_reduce([not path.exists(), stop.requested], device, dist.ReduceOp.MAX)
        if stopping:
            return None
        if not missing:
            return read_batch(rd, step, dist.get_world_size(), async_level)
        if time.monotonic() - last_note > 60:
            logger.info(f"waiting for {path}")
            last_note = time.monotonic()
        time.sleep(poll_s)


def peak_memory(device: torch.device) -> dict[str, float]:
    """The most GPU memory any rank's tensors held (`perf/peak_memory_gib`) and its caching allocator
    reserved (`perf/peak_reserved_gib`) since the last step's report, which resets both; {} on CPU."""
    if device.type != "cuda":
        return {}
    gib = 2**30
    allocated, reserved = all_reduce([torch.cuda.max_memory_allocated(device) / gib,
                                      torch.cuda.max_memory_reserved(device) / gib], device, dist.ReduceOp.MAX)
    torch.cuda.reset_peak_memory_stats(device)
    return {"perf/peak_memory_gib": allocated, "perf/peak_reserved_gib": reserved}


def compiled_frames() -> int:
    """Frames torch.compile's Dynamo has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["frames"].get("total", 0)


def compiled_in_step(step: int, frames_before: int, train_s: float, expected: bool) -> int:
    """Frames compiled since `frames_before` (`perf/compiled_frames`), with a warning when that was not
    `expected` (a launch's first step without the prewarm): a shape or guard neither the prewarm nor
    the steps before had met, which costs seconds of the step on a GPU."""
    compiled = compiled_frames() - frames_before
    if compiled and not expected and dist.get_rank() == 0:
        logger.warning(f"step {step}: torch.compile compiled {compiled} frame(s) in this step ({train_s:.1f}s), shapes "
                       "or guards the prewarm and earlier steps had not met; TORCH_LOGS=recompiles in the trainer's "
                       "environment says which")
    return compiled


def fault_hang(step: int, rank: int) -> None:
    """Test-only: PRL_FAULT_HANG_AT_STEP=N makes rank 0 hang at the start of step N, as a stuck
    kernel or filesystem would; the other ranks then wait in the step's first collective."""
    if rank == 0 and os.environ.get("PRL_FAULT_HANG_AT_STEP") == str(step):
        logger.warning(f"PRL_FAULT_HANG_AT_STEP={step}: hanging")
        threading.Event().wait()


def train_step(model, optimizer, scheduler, micro_batches: list[dict], cfg: TrainerConfig, device,
               loss_fn: PolicyLoss, behaviour=None) -> dict[str, float]:
    """Forward/backward every micro-batch of this rank, then one optimizer step.

    `behaviour(device micro-batches) -> own`: recomputes the behaviour logprobs in place
    (prl.trainer.behaviour), or says the training forward's own serve (own=True)."""
    tokens, loss_tokens = count_tokens(micro_batches)
    total_tokens, total_loss_tokens = all_reduce([tokens, loss_tokens], device)
    # Every copy queued first; nothing below waits for the GPU until the grad norm is read.
    micro_batches = [to_device(mb, device) for mb in micro_batches]
    # Before the skip: it also keeps this version for later batches, which a skipped step publishes too.
    own_logprobs = behaviour(micro_batches) if behaviour is not None else False
    if total_loss_tokens == 0:  # every rank sees the same total, so all of them take this branch
        return skip_step(scheduler, total_tokens, loss_fn)
    stats = 0.0  # the sums of loss_fn.stats (a custom loss names them at its first call)
    for i, mb in enumerate(micro_batches):
        accumulate(model, last=i == len(micro_batches) - 1)
        logprobs, entropy = model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"], mb["max_len"])
        if own_logprobs:  # the batch came from these very weights: ratio 1, the on-policy gradient
            mb["behaviour_logprobs"] = logprobs.detach()
        loss, mb_stats = loss_fn(logprobs, entropy, mb, int(total_loss_tokens))
        loss.backward()
        stats = stats + mb_stats
    grad_norm, lr = optimizer_step(model, optimizer, scheduler, cfg)
    dist.all_reduce(stats)
    metrics = {f"train/{k}": v for k, v in loss_fn.metrics(stats).items()}
    return metrics | {"train/grad_norm": grad_norm, "train/lr": lr, "perf/tokens": total_tokens}


def accumulate(model, last: bool) -> None:
    """Before each micro-batch's forward: with unsharded accumulation, reduce-scatter once per step,
    after the last micro-batch, and keep the gathered bf16 parameters until then: no all-gather
    (cast + copies) between micro-batches. Costs 6 bytes per parameter on every rank (fp32
    gradients, bf16 weights): see parallelize."""
    if model.accumulate_unsharded:
        model.set_requires_gradient_sync(last)
        model.set_reshard_after_backward(last)


def optimizer_step(model, optimizer, scheduler, cfg: TrainerConfig) -> tuple[float, float]:
    """Clip, step, zero the gradients; (grad norm before the clip, the learning rate used)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return grad_norm.item(), lr


def skip_step(scheduler, total_tokens: float, loss_fn: PolicyLoss) -> dict[str, float]:
    """A batch without loss tokens (the orchestrator filtered every group): no forward, no optimizer
    step, since AdamW with zero gradients would still move the weights (momentum, weight decay).
    The scheduler still steps, so the learning rate stays a function of the step number."""
    lr = scheduler.get_last_lr()[0]
    with warnings.catch_warnings():
        # "lr_scheduler.step() before optimizer.step()" (when step 0 is the empty one): LambdaLR's
        # value is a function of its step count, nothing is skipped.
        warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
        scheduler.step()
    # (A custom loss not yet called has no stat names: its step shows the token count only.)
    zeros = loss_fn.metrics(torch.zeros(len(loss_fn.stats))) if loss_fn.stats else {"loss_tokens": 0.0}
    metrics = {f"train/{k}": v for k, v in zeros.items()}
    return metrics | {"train/grad_norm": 0.0, "train/lr": lr, "perf/tokens": total_tokens, "train/skipped": 1.0}


def resume(rd: RunDir, resume_step: int | None, model, optimizer, scheduler, behaviour: BehaviourPolicy | None) -> int:
    """The step to start at: 0, the newest complete checkpoint, or `--resume-step`."""
    if resume_step is not None and not is_complete(checkpoint_dir(rd, resume_step)):
        raise FileNotFoundError(f"--resume-step {resume_step}: {checkpoint_dir(rd, resume_step)} is not a complete checkpoint")
    step = resume_step if resume_step is not None else newest_complete(rd)
    if step is None:
        logger.info("no complete checkpoint: starting at step 0")
        return 0
    step = load_checkpoint(rd, step, model, optimizer, scheduler, behaviour)
    logger.info(f"resumed from checkpoint step {step}")
    return step


def publish_resumed_version(model, cfg: Config, rd: RunDir, step: int, source: Path) -> None:
    """After resuming at `step`, make version `step` the newest the orchestrator can find.

    Versions above it come from the attempt that was cut short (the run recomputes them, maybe
    not bit-identically on GPU); version `step` itself may have been pruned since.
    """
    keep = weights_kept(cfg.run.async_level)
    if dist.get_rank() == 0:
        prune_weights(rd, newest=step, keep=keep)
    if not is_complete(weights_dir(rd, step)):
        save_weights(model, getattr(torch, cfg.model.dtype), source, rd, step, keep, adapter=adapter_of(cfg))


def start_broadcast(cfg: Config, device: torch.device) -> Sender | None:
    """Rank 0's weight broadcast to the servers (inference.weight_transfer: broadcast), else None."""
    if cfg.inference.weight_transfer != "broadcast" or dist.get_rank() != 0:
        return None
    if (attempt := Attempt.current()) is None:
        logger.warning(f"inference.weight_transfer is broadcast but ${LOG_DIR_ENV} is unset (not a launch of the run): "
                       "weights go by file only")
        return None
    backend = os.environ.get(WEIGHTS_BACKEND_ENV) or ("nccl" if device.type == "cuda" and cfg.inference.gpus_per_node else "gloo")
    workers = cfg.inference.tensor_parallel * cfg.inference.data_parallel
    return Sender(bc.Access.of(attempt), bc.host_address(), 1 + workers, backend, device,
                  slots=versions_in_flight(cfg.run.async_level), timeout_s=bc.TIMEOUT_S,
                  last_version=last_policy_version(cfg.run.max_steps, cfg.run.async_level))


def mark_preempted(step: int) -> None:
    """`$PRL_LOG_DIR/preempted`, once the checkpoint is complete: the job script requeues on it.
    torchrun reports any failing rank as exit status 1, so the ranks' 42 does not reach the script."""
    if dist.get_rank() == 0 and (attempt := Attempt.current()) is not None:
        attempt.write(PREEMPTED, f"trainer: checkpoints/step_{step}\n")


def train(cfg: Config, rd: RunDir, resume_step: int | None) -> int:
    stop = StopFlag()
    rank_log = setup_logging("trainer", int(os.environ.get("RANK", 0)))
    loss_fn = build_loss(cfg.trainer.loss)  # a custom loss that cannot be imported fails here, first
    watchdog = Watchdog.start(cfg.watchdog, "trainer", int(os.environ.get("RANK", 0)), dump_to=rank_log)
    watchdog.expect("rendezvous, model load and resume", cfg.watchdog.ready_timeout_s)
    device = init_distributed(cfg.trainer, cfg.watchdog.ready_timeout_s)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    seed_everything(cfg.run.seed, device, cfg.trainer.deterministic)
    logger.info(f"rank {rank}/{world_size} on {device}, run dir {rd.path}")

    model = build_model(cfg.model, cfg.trainer, cfg.orchestrator.sampling.temperature, device)
    optimizer, scheduler = build_optimizer(model, cfg.trainer, device)
    source = model_source_dir(cfg.model.name)
    behaviour = None
    if cfg.trainer.behaviour_logprobs == "recompute":
        behaviour = BehaviourPolicy(model, cfg.run.async_level, model.compute_dtype, cfg.trainer.behaviour_on_host)
    start = resume(rd, resume_step, model, optimizer, scheduler, behaviour)
    if start > 0:
        publish_resumed_version(model, cfg, rd, start, source)
    reporter = StepReporter(cfg, rd, rank)
    dtype, keep_weights, adapter = getattr(torch, cfg.model.dtype), weights_kept(cfg.run.async_level), adapter_of(cfg)
    save = functools.partial(save_checkpoint, rd, model=model, optimizer=optimizer, scheduler=scheduler,
                             keep_last=cfg.trainer.checkpoint.keep_last, behaviour=behaviour)
    # The data order of the last batch consumed, kept by every checkpoint (prl.run.batch): the resumed one's at first.
    data_order = read_data_order(rd, start)

    def checkpoint(step: int, data_order: dict | None) -> None:
        # The versions a resume from `step` loads, published without an fsync, reach the disk first.
        writer.wait()
        if rank == 0:
            make_durable(rd, step, keep_weights)
        save(step, data_order=data_order)
        # Versions kept only for a resume from the previous checkpoint can go now (prune_weights).
        if rank == 0:
            prune_weights(rd, newest=step, keep=keep_weights)

    prewarm_s = None
    # While the servers start and generate the first batch; by default where a step has kernels to build.
    if cfg.trainer.prewarm or (cfg.trainer.prewarm is None and device.type == "cuda"):
        lengths = micro_batch_lengths(cfg.model.max_model_len, cfg.trainer.micro_batch_size, cfg.trainer.micro_batch_tokens,
                                      world_size)
        prewarm_s = prewarm(model, accumulate, device, model.causal_lm.config.vocab_size, lengths,
                            no_grad_forward=behaviour is not None, loss_fn=loss_fn)
        if prewarm_s is not None:
            logger.info(f"prewarmed in {prewarm_s:.1f}s: forward and backward of {len(lengths)} synthetic "
                        f"micro-batches of {', '.join(str(sum(n)) for n in lengths)} tokens")
    writer = BackgroundWriter()  # rank 0's weight files: written while the next step computes
    sender = start_broadcast(cfg, device)
    pin_staging_ahead(model, dtype, writer, sender, adapter, version=start + 1)
    # The first batch needs the servers up (the orchestrator's own readiness deadline), then one batch.
    watchdog.expect(f"batch {start} ({batch_path(rd, start).name})", cfg.watchdog.ready_timeout_s + watchdog.window())
    ready_s = Attempt.since_current_launch()  # model built, resumed, ready for its first batch

    for step in range(start, cfg.run.max_steps):
        wait_start = time.perf_counter()
        batch = wait_for_batch(rd, step, cfg.run.async_level, stop, device, cfg.trainer.batch_poll_s)
        if batch is None:
            logger.info(f"stop requested: checkpointing step {step} and exiting {PREEMPTED_EXIT_CODE} ({stop.reason()})")
            checkpoint(step, data_order)
            writer.wait()
            mark_preempted(step)
            return finish(reporter, watchdog, PREEMPTED_EXIT_CODE, sender)
        data_order = batch.data_order
        fault_hang(step, rank)
        step_start, frames = time.perf_counter(), compiled_frames()
        prepare = functools.partial(behaviour.prepare, step, batch.policy_version) if behaviour else None
        metrics = train_step(model, optimizer, scheduler, batch.micro_batches[rank], cfg.trainer, device, loss_fn,
                             prepare)
        train_s = time.perf_counter() - step_start
        if cfg.trainer.compile:
            first_unwarmed = step == start and prewarm_s is None
            metrics["perf/compiled_frames"] = compiled_in_step(step, frames, train_s, expected=first_unwarmed)
        if metrics.get("train/skipped") and rank == 0:
            logger.warning(f"step {step}: batch {step} has no loss tokens (the orchestrator filtered every group: equal "
                           f"rewards); weights left unchanged, version {step + 1} published all the same")

        export_start = time.perf_counter()
        save_weights(model, dtype, source, rd, step + 1, keep_weights, writer, sender, adapter, durable=False)
        export_s = time.perf_counter() - export_start
        interval = cfg.trainer.checkpoint.interval
        if interval and (step + 1) % interval == 0:
            checkpoint(step + 1, data_order)

        # The orchestrator's metrics under rollout/, but per-environment (env/NAME/...), eval and startup ones as they are.
        metrics |= {(k if k.startswith(("env/", "eval/", "startup/")) else f"rollout/{k}"): float(v)
                    for k, v in batch.metrics.items() if isinstance(v, (int, float))}
        if step == start and ready_s is not None:
            metrics |= {"startup/trainer_ready_s": ready_s, "startup/first_step_s": Attempt.since_current_launch() or 0.0}
            metrics |= {"startup/prewarm_s": prewarm_s} if prewarm_s is not None else {}
        metrics |= {
            "perf/tokens_per_s": metrics["perf/tokens"] / train_s,
            "perf/train_s": train_s,
            "perf/export_s": export_s,
            # The previous version's write, hand-off to COMPLETE, which this step's save_weights waited
            # for (on a checkpoint step this one's, which the checkpoint waited for; none on a launch's
            # first step): what a version's load waits for.
            **({"perf/publish_s": writer.last_s} if writer.last_s is not None else {}),
            "perf/wait_s": step_start - wait_start,
            "perf/step_s": time.perf_counter() - wait_start,
            # Of train_s, the recompute's forward (trainer.behaviour_logprobs: recompute): what vLLM's
            # logprobs would save it.
            **({"perf/behaviour_s": behaviour.last_seconds()} if behaviour is not None else {}),
        }
        metrics |= peak_memory(device)
        reporter.report(step, metrics)
        watchdog.progress(f"batch {step + 1} and its step")

    # The run's end is a checkpoint too: a later, longer run resumes from it. A stop requested
    # meanwhile changes nothing: the run is complete once it is.
    checkpoint(cfg.run.max_steps, data_order)
    writer.wait()
    return finish(reporter, watchdog, 0, sender)


def finish(reporter: StepReporter, watchdog: Watchdog, exit_code: int, sender: Sender | None) -> int:
    """After the last checkpoint this attempt writes: a signal can no longer kill the rank (see
    stop.ignore), and the deadlines are off."""
    ignore_stop_signals()
    if sender is not None:
        sender.close()
    watchdog.stop()
    reporter.finish()
    dist.destroy_process_group()
    return exit_code
