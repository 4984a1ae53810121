"""The RL trainer loop: batch n from the orchestrator in, policy version n+1 out.

    torchrun --nproc-per-node 8 jobs/trainer.py RUN/config.yaml

Reads RUN/rollouts/step_N.pt, writes RUN/weights/step_{N+1}/ and RUN/checkpoints/step_N/
(docs/architecture.md). `train` is the story: a Rank (prl.trainer.rank: deadlines, process group, the
one teardown) and a Trainer ready for its first batch, whose `run` waits, steps, publishes,
checkpoints and reports, step after step. It resumes from the newest complete checkpoint (`prl resume
--step N` rewinds the run directory to an older one first). SIGUSR1/SIGTERM or
`$PRL_LOG_DIR/stop_requested`: checkpoint at the next step boundary, write $PRL_LOG_DIR/preempted,
exit 42 (torchrun itself then exits 1: the job script keys on the file). Deadlines (prl.run.watchdog):
rendezvous, model load and resume within watchdog.ready_timeout_s; each next batch and step within
the stall window, else `$PRL_LOG_DIR/stalled` and exit 16.

Test-only fault injection: PRL_FAULT_HANG_AT_STEP=N hangs rank 0 at the start of step N;
PRL_FAULT_CHECKPOINT_DELAY_S=S[@N] (prl.trainer.ckpt) slows every checkpoint write, or step N's.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from loguru import logger

from prl.config import Config, TrainerConfig
from prl.run import broadcast as bc
from prl.run.attempt import LOG_DIR_ENV, Attempt
from prl.run.batch import (ROUTED_KEY, Batch, batch_path, last_policy_version, read_batch, read_data_order,
                           versions_in_flight, weights_kept)
from prl.run.log import setup_logging
from prl.run.protocol import WEIGHTS_BACKEND_ENV
from prl.run.rundir import RunDir, is_complete
from prl.trainer.behaviour import BehaviourPolicy
from prl.trainer.broadcast_sender import Sender
from prl.trainer.ckpt import checkpoint_due, load_newest, save_checkpoint
from prl.trainer.export import (BackgroundWriter, adapter_of, make_durable, model_source_dir, pin_staging_ahead,
                               prune_weights, save_weights, weights_dir)
from prl.trainer.loss import PolicyLoss, build_loss
from prl.trainer.metrics import StepReporter
from prl.trainer.model import build_model
from prl.trainer.optim import StochasticAdamW
from prl.trainer.prewarm import micro_batch_lengths, prewarm
from prl.trainer.replay import replayed_positions
from prl.trainer.rank import Rank, all_reduce, peak_memory, preempted, rank_number
from prl.trainer.samples import count_tokens, to_device
from prl.trainer.stop import StopFlag


def build_optimizer(model: torch.nn.Module, cfg: TrainerConfig, device: torch.device):
    # With adapters (trainer.lora) only they train: no optimizer state for the frozen base.
    trained = trained_tensors(model)
    # bf16 weights: torch's AdamW would round every update away; moments on the host: torch's has no way
    if cfg.master_dtype == "bfloat16" or cfg.offload_optimizer:
        optimizer = StochasticAdamW(trained, lr=cfg.lr, weight_decay=cfg.weight_decay, compiled=device.type == "cuda",
                                    state_on_host=cfg.offload_optimizer)
    else:
        # Fused: one kernel family for all tensors; on the host too with trainer.offload (the shards
        # live there; torch's CPU kernel is one multi-threaded pass).
        fused = device.type == "cuda" or cfg.offload
        optimizer = torch.optim.AdamW(trained, lr=cfg.lr, weight_decay=cfg.weight_decay, fused=fused)
    warmup = cfg.warmup_steps
    # Linear warm-up from lr/warmup at the first step to lr, then constant.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) if warmup else 1.0)
    return optimizer, scheduler


def wait_for_batch(rd: RunDir, step: int, async_level: int, stop: StopFlag, device: torch.device,
                   poll_s: float, teacher: bool = False) -> Batch | None:
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
            return read_batch(rd, step, dist.get_world_size(), async_level, teacher)
        if time.monotonic() - last_note > 60:
            logger.info(f"waiting for {path}")
            last_note = time.monotonic()
        time.sleep(poll_s)


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
    total_tokens, total_loss_tokens, replayed = all_reduce([tokens, loss_tokens, replayed_positions(micro_batches)],
                                                           device)
    # Every copy queued first; nothing below waits for the GPU until the grad norm is read.
    micro_batches = [to_device(mb, device) for mb in micro_batches]
    # Before the skip: it also keeps this version for later batches, which a skipped step publishes too.
    own_logprobs = behaviour(micro_batches) if behaviour is not None else False
    if total_loss_tokens == 0:  # every rank sees the same total, so all of them take this branch
        return skip_step(scheduler, total_tokens, loss_fn)
    stats = 0.0  # the sums of loss_fn.stats (a custom loss names them at its first call)
    if model.routing is not None:
        model.routing.reset()
    for i, mb in enumerate(micro_batches):
        accumulate(model, last=i == len(micro_batches) - 1)
        logprobs, entropy = model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"], mb["max_len"], mb.get(ROUTED_KEY))
        if own_logprobs:  # the batch came from these very weights: ratio 1, the on-policy gradient
            mb["behaviour_logprobs"] = logprobs.detach()
        loss, mb_stats = loss_fn(logprobs, entropy, mb, int(total_loss_tokens))
        if cfg.router_aux_loss_coef:  # a micro-batch's mean, weighted by its share of the step's tokens
            loss = loss + cfg.router_aux_loss_coef * model.routing.aux_loss * (mb["input_ids"].numel() / total_tokens)
        loss.backward()
        stats = stats + mb_stats
    grad_norm, lr = optimizer_step(model, optimizer, scheduler, cfg)
    dist.all_reduce(stats)
    metrics = {f"train/{k}": v for k, v in loss_fn.metrics(stats).items()}
    metrics |= model.routing.metrics() if model.routing is not None else {}
    metrics |= {"train/routing_replayed": replayed / total_tokens} if cfg.routing_replay else {}
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
    """Clip, step, zero the gradients; (grad norm before the clip, the learning rate used).

    torch's fused AdamW divides each gradient by the optimizer's `grad_scale` inside its kernel (what
    AMP's GradScaler sets): there the clip is that division, not a pass of its own over every gradient
    (at 1.5B on an H200 the optimizer's GPU time 18.2 -> 16.8 ms)."""
    grad_norm = clip(model, optimizer, cfg)
    lr = scheduler.get_last_lr()[0]
    optimizer.step()
    optimizer.__dict__.pop("grad_scale", None)  # a later step sets its own
    scheduler.step()
    if (flat := getattr(model, "flat", None)) is not None:
        flat.stepped()  # its gradient stays allocated: the next step's first gradients overwrite it
    else:
        optimizer.zero_grad(set_to_none=True)
    return grad_norm.item(), lr


def clip(model, optimizer, cfg: TrainerConfig) -> torch.Tensor:
    """The gradients' norm before the clip, with the clip applied: as fused AdamW's grad_scale, 1 /
    clip_grad_norm_'s coefficient (max_norm / (norm + 1e-6), capped at 1), else to the gradients."""
    fused = isinstance(optimizer, torch.optim.AdamW) and optimizer.defaults.get("fused")
    flat, params = getattr(model, "flat", None), trained_tensors(model)
    if flat is None and not fused:
        return full(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))
    if flat is not None:
        flat.gradients_done()
    norm = flat.grad_norm() if flat is not None else full(torch.nn.utils.get_total_norm(
        [p.grad for p in params if p.grad is not None]))
    if fused:
        optimizer.grad_scale = ((norm.float() + 1e-6) / cfg.max_grad_norm).clamp(min=1.0)
    else:
        torch.nn.utils.clip_grads_with_norm_(params, cfg.max_grad_norm, norm)
    return norm


def trained_tensors(model) -> list[torch.Tensor]:
    """What the optimizer updates: the trained parameters, or with trainer.flat_params their one flat tensor."""
    flat = getattr(model, "flat", None)
    return [flat.master] if flat is not None else [p for p in model.parameters() if p.requires_grad]


def full(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a partial norm all-reduced), else the tensor."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


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


class Trainer:
    """The RL loop on this rank: the policy it trains, the versions it publishes, the checkpoints it
    writes. Made ready for its first batch (model, resume, prewarm); `run` is the story."""

    def __init__(self, cfg: Config, rd: RunDir, rank: Rank, loss_fn: PolicyLoss, stop: StopFlag):
        self.cfg, self.rd, self.rank, self.loss_fn, self.stop = cfg, rd, rank, loss_fn, stop
        logger.info(f"rank {rank.number}/{rank.world_size} on {rank.device}, run dir {rd.path}")
        self.model = build_model(cfg.model, cfg.trainer, cfg.orchestrator.sampling.temperature, rank.device)
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.trainer, rank.device)
        self.source = model_source_dir(cfg.model.name)
        self.behaviour = None
        if cfg.trainer.behaviour_logprobs == "recompute":
            self.behaviour = BehaviourPolicy(self.model, cfg.run.async_level, self.model.compute_dtype,
                                             cfg.trainer.behaviour_on_host)
        self.start = self.resume()
        rank.reporter = StepReporter(cfg, rd, rank.number)
        self.dtype, self.adapter = getattr(torch, cfg.model.dtype), adapter_of(cfg)
        self.keep_weights = weights_kept(cfg.run.async_level)
        # The data order of the last batch consumed, kept by every checkpoint (prl.run.batch): the
        # resumed one's at first.
        self.data_order = read_data_order(rd, self.start)
        self.prewarm_s = self.warm_up()
        self.writer = BackgroundWriter()  # rank 0's weight files: written while the next step computes
        rank.sender = start_broadcast(cfg, rank.device)
        pin_staging_ahead(self.model, self.dtype, self.writer, rank.sender, self.adapter, version=self.start + 1)
        # The first batch needs the servers up (the orchestrator's own readiness deadline), then one batch.
        rank.watchdog.expect(f"batch {self.start} ({batch_path(rd, self.start).name})",
                             cfg.watchdog.ready_timeout_s + rank.watchdog.window())
        self.ready_s = Attempt.since_current_launch()  # model built, resumed, ready for its first batch

    def run(self) -> int:
        """Each step: wait for its batch, train on it, publish the next policy version, checkpoint
        when due, report. Then the run's last checkpoint: 0; or, asked to stop, a checkpoint where
        it stopped: prl.run.protocol.RANK_EXIT_PREEMPTED (rank.preempted)."""
        for step in range(self.start, self.cfg.run.max_steps):
            wait_start = time.perf_counter()
            batch = wait_for_batch(self.rd, step, self.cfg.run.async_level, self.stop, self.rank.device,
                                   self.cfg.trainer.batch_poll_s, self.cfg.teacher is not None)
            if batch is None:
                return preempted(step, self.stop, self.checkpoint)
            self.data_order = batch.data_order
            fault_hang(step, self.rank.number)
            step_start = time.perf_counter()
            metrics, train_s = self.train_on(step, batch)
            export_s = self.publish(step + 1)
            if checkpoint_due(self.cfg.trainer.checkpoint, step + 1):
                self.checkpoint(step + 1)
            self.report(step, batch, metrics, {"perf/train_s": train_s, "perf/export_s": export_s,
                                               "perf/wait_s": step_start - wait_start,
                                               "perf/step_s": time.perf_counter() - wait_start})
        # The run's end is a checkpoint too: a later, longer run resumes from it. A stop requested
        # meanwhile changes nothing: the run is complete once it is.
        self.checkpoint(self.cfg.run.max_steps)
        return 0

    def resume(self) -> int:
        """The step to start at (ckpt.load_newest); resumed, its version published again (publish_resumed_version)."""
        start = load_newest(self.rd, self.model, self.optimizer, self.scheduler, self.behaviour)
        if start > 0:
            publish_resumed_version(self.model, self.cfg, self.rd, start, self.source)
        return start

    def warm_up(self) -> float | None:
        """Seconds of the prewarm (prl.trainer.prewarm), or None when it did not run: by default where
        a step has kernels to build. It runs while the servers start and generate the first batch."""
        trainer, device = self.cfg.trainer, self.rank.device
        if not (trainer.prewarm or (trainer.prewarm is None and device.type == "cuda")):
            return None
        if isinstance(self.optimizer, StochasticAdamW):  # its compiled update, else built in the first step
            self.optimizer.warm()
        lengths = micro_batch_lengths(self.cfg.model.max_model_len, trainer.micro_batch_size,
                                      trainer.micro_batch_tokens, self.rank.world_size)
        seconds = prewarm(self.model, accumulate, device, self.model.causal_lm.config.vocab_size, lengths,
                          no_grad_forward=self.behaviour is not None, loss_fn=self.loss_fn)
        if seconds is not None:
            logger.info(f"prewarmed in {seconds:.1f}s: forward and backward of {len(lengths)} synthetic "
                        f"micro-batches of {', '.join(str(sum(n)) for n in lengths)} tokens")
        return seconds

    def train_on(self, step: int, batch: Batch) -> tuple[dict[str, float], float]:
        """One optimizer step on this rank's share of `batch`: (its metrics, seconds it took)."""
        start, frames = time.perf_counter(), compiled_frames()
        prepare = functools.partial(self.behaviour.prepare, step, batch.policy_version) if self.behaviour else None
        metrics = train_step(self.model, self.optimizer, self.scheduler, batch.micro_batches[self.rank.number],
                             self.cfg.trainer, self.rank.device, self.loss_fn, prepare)
        train_s = time.perf_counter() - start
        if self.cfg.trainer.compile:
            first_unwarmed = step == self.start and self.prewarm_s is None
            metrics["perf/compiled_frames"] = compiled_in_step(step, frames, train_s, expected=first_unwarmed)
        if metrics.get("train/skipped") and self.rank.number == 0:
            logger.warning(f"step {step}: batch {step} has no loss tokens (the orchestrator filtered every group: "
                           f"equal rewards); weights left unchanged, version {step + 1} published all the same")
        return metrics, train_s

    def publish(self, version: int) -> float:
        """Policy version `version` to the servers (prl.trainer.export.save_weights: rank 0 writes the
        file in the background, and broadcasts it where configured); seconds until the loop goes on."""
        start = time.perf_counter()
        save_weights(self.model, self.dtype, self.source, self.rd, version, self.keep_weights, self.writer,
                     self.rank.sender, self.adapter, durable=False)
        return time.perf_counter() - start

    def checkpoint(self, step: int) -> None:
        """Checkpoint `step` with the data order of the last batch consumed; every weight write is
        done when it returns (no write is pending when the rank ends)."""
        # The versions a resume from `step` loads, published without an fsync, reach the disk first.
        self.writer.wait()
        if self.rank.number == 0:
            make_durable(self.rd, step, self.keep_weights)
        save_checkpoint(self.rd, step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                        keep_last=self.cfg.trainer.checkpoint.keep_last, behaviour=self.behaviour,
                        data_order=self.data_order)
        # Versions kept only for a resume from the previous checkpoint can go now (prune_weights).
        if self.rank.number == 0:
            prune_weights(self.rd, newest=step, keep=self.keep_weights)

    def report(self, step: int, batch: Batch, metrics: dict[str, float], seconds: dict[str, float]) -> None:
        """The step's metrics with the batch's, the launch's startup and the step's timings; then the
        next deadline: batch step + 1 and its step."""
        # The orchestrator's metrics under rollout/, but per-environment (env/NAME/...), eval and startup
        # ones as they are.
        metrics |= {(k if k.startswith(("env/", "eval/", "startup/")) else f"rollout/{k}"): float(v)
                    for k, v in batch.metrics.items() if isinstance(v, (int, float))}
        if step == self.start and self.ready_s is not None:
            metrics |= {"startup/trainer_ready_s": self.ready_s,
                        "startup/first_step_s": Attempt.since_current_launch() or 0.0}
            metrics |= {"startup/prewarm_s": self.prewarm_s} if self.prewarm_s is not None else {}
        metrics |= {
            "perf/tokens_per_s": metrics["perf/tokens"] / seconds["perf/train_s"],
            **seconds,
            # The previous version's write, hand-off to COMPLETE, which this step's save_weights waited
            # for (on a checkpoint step this one's, which the checkpoint waited for; none on a launch's
            # first step): what a version's load waits for.
            **({"perf/publish_s": self.writer.last_s} if self.writer.last_s is not None else {}),
            # Of train_s, the recompute's forward (trainer.behaviour_logprobs: recompute): what vLLM's
            # logprobs would save it.
            **({"perf/behaviour_s": self.behaviour.last_seconds()} if self.behaviour is not None else {}),
        }
        metrics |= peak_memory(self.rank.device)
        self.rank.reporter.report(step, metrics)
        self.rank.watchdog.progress(f"batch {step + 1} and its step")


def train(cfg: Config, rd: RunDir) -> int:
    """The RL trainer rank, start to end; its exit status (module docstring). Whichever way it ends
    (the last step, a stop request, an error), the rank's teardown is Rank's, in one place."""
    stop = StopFlag()
    rank_log = setup_logging("trainer", rank_number())
    loss_fn = build_loss(cfg.trainer.loss)  # a custom loss that cannot be imported fails here, first
    with Rank.start(cfg, rank_log, "rendezvous, model load and resume") as rank:
        return Trainer(cfg, rd, rank, loss_fn, stop).run()
