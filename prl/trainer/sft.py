"""The SFT job's trainer loop: chat data in, weights out, with the RL trainer's model, checkpoints,
resume and stop rules.

    prl submit configs/sft_toy.yaml --local          # a config with an `sft:` section and no orchestrator
    torchrun --nproc-per-node 8 jobs/trainer.py RUN/config.yaml      # what the job runs

Step n trains on the rows prl.trainer.sft_data.DataOrder gives it, packed into micro-batches as the
orchestrator packs rollouts (prl.run.packing): the loss is the negative log-likelihood of the
assistant messages' tokens, averaged over every such token of the step (all micro-batches, all
ranks), so it does not depend on the packing. Every trainer.checkpoint.interval steps and at the end
it writes RUN/checkpoints/step_N/ and RUN/weights/step_N/ (an RL config names the last as
model.name). SIGUSR1/SIGTERM or `$PRL_LOG_DIR/stop_requested`: checkpoint at the next step boundary,
write `$PRL_LOG_DIR/preempted`, exit 42; the job requeues and resumes at that step, the data order
being a function of the step alone.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist
from loguru import logger

from prl.config import Config, TrainerConfig
from prl.run.log import setup_logging
from prl.run.packing import pack_batch
from prl.run.protocol import RANK_EXIT_PREEMPTED
from prl.run.rundir import RunDir, is_complete
from prl.run.watchdog import Watchdog
from prl.trainer.ckpt import save_checkpoint
from prl.trainer.export import adapter_of, model_source_dir, save_weights, weights_dir
from prl.trainer.metrics import StepReporter
from prl.trainer.model import build_model
from prl.trainer.samples import count_tokens, to_device
from prl.trainer.sft_data import DataOrder, load_rows, tokenize
from prl.trainer.stop import StopFlag
from prl.trainer.train import (
    accumulate, all_reduce, build_optimizer, finish, init_distributed, mark_preempted, optimizer_step, peak_memory,
    resume, seed_everything,
)


def step_micro_batches(tokenizer, rows: list[dict], order: DataOrder, step: int, cfg: Config) -> tuple[list[list[dict]], int]:
    """(micro-batches per rank, conversations cut to model.max_model_len) of step `step`: every rank
    tokenizes the step's rows and packs them alike, then takes its own share."""
    key, samples, cut = cfg.sft.messages_key, [], 0
    for row in order.rows(step):
        sample, was_cut = tokenize(tokenizer, rows[row].get(key), cfg.model.max_model_len, row,
                                   rows[row].get(cfg.sft.tools_key))
        samples.append(sample)
        cut += was_cut
    per_rank = pack_batch(samples, cfg.trainer.world_size, cfg.trainer.micro_batch_size, cfg.trainer.micro_batch_tokens)
    return per_rank, cut


def sft_step(model, optimizer, scheduler, micro_batches: list[dict], cfg: TrainerConfig, device) -> dict[str, float]:
    """Forward/backward of this rank's micro-batches, then one optimizer step: mean NLL per assistant
    token. As the RL step (prl.trainer.train.train_step), every copy to the device is queued first."""
    tokens, loss_tokens = count_tokens(micro_batches)
    total_tokens, total_loss_tokens = all_reduce([tokens, loss_tokens], device)
    micro_batches = [to_device(mb, device) for mb in micro_batches]
    nll = torch.zeros((), dtype=torch.float64, device=device)
    for i, mb in enumerate(micro_batches):
        accumulate(model, last=i == len(micro_batches) - 1)
        logprobs, _ = model(mb["input_ids"], mb["position_ids"], mb["cu_seqlens"], mb["max_len"])
        loss = -(logprobs * mb["loss_mask"]).sum() / max(total_loss_tokens, 1.0)
        loss.backward()
        nll += loss.detach().double()
    grad_norm, lr = optimizer_step(model, optimizer, scheduler, cfg)
    dist.all_reduce(nll)
    return {"train/loss": nll.item(), "train/loss_tokens": total_loss_tokens, "train/grad_norm": grad_norm,
            "train/lr": lr, "perf/tokens": total_tokens}


def train_sft(cfg: Config, rd: RunDir, resume_step: int | None) -> int:
    stop = StopFlag()
    rank = int(os.environ.get("RANK", 0))
    rank_log = setup_logging("trainer", rank)
    watchdog = Watchdog.start(cfg.watchdog, "trainer", rank, dump_to=rank_log)
    watchdog.expect("rendezvous, data, model load and resume", cfg.watchdog.ready_timeout_s)
    device = init_distributed(cfg.trainer, cfg.watchdog.ready_timeout_s)
    seed_everything(cfg.run.seed, device, cfg.trainer.deterministic)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name, trust_remote_code=cfg.model.trust_remote_code)
    rows = load_rows(cfg.sft)
    order = DataOrder(len(rows), cfg.sft.batch_size, cfg.run.seed, cfg.sft.shuffle)
    logger.info(f"SFT: {len(rows)} conversations from {cfg.sft.data}, {cfg.sft.batch_size} per step, "
                f"rank {dist.get_rank()}/{dist.get_world_size()} on {device}, run dir {rd.path}")
    model = build_model(cfg.model, cfg.trainer, 1.0, device)  # temperature 1: the data's own distribution
    optimizer, scheduler = build_optimizer(model, cfg.trainer, device)
    start = resume(rd, resume_step, model, optimizer, scheduler, None)
    reporter = StepReporter(cfg, rd, dist.get_rank())
    source, dtype, keep = model_source_dir(cfg.model.name), getattr(torch, cfg.model.dtype), cfg.trainer.checkpoint.keep_last

    def checkpoint(step: int) -> None:
        """The full state, and the weights an RL run or `prl eval` can start from (with adapters:
        folded into the base weights)."""
        save_checkpoint(rd, step, model=model, optimizer=optimizer, scheduler=scheduler, keep_last=keep)
        if not is_complete(weights_dir(rd, step)):
            save_weights(model, dtype, source, rd, step, keep, adapter=adapter_of(cfg, folded=True))

    watchdog.progress(f"step {start}")
    for step in range(start, cfg.run.max_steps):
        stopping, = all_reduce([stop.requested], device, dist.ReduceOp.MAX)  # every rank takes the same branch
        if stopping:
            logger.info(f"stop requested: checkpointing step {step} and exiting {RANK_EXIT_PREEMPTED} ({stop.reason()})")
            checkpoint(step)
            mark_preempted(step)
            return finish(reporter, watchdog, RANK_EXIT_PREEMPTED, None)
        step_start = time.perf_counter()
        per_rank, cut = step_micro_batches(tokenizer, rows, order, step, cfg)
        data_s = time.perf_counter() - step_start
        metrics = sft_step(model, optimizer, scheduler, per_rank[dist.get_rank()], cfg.trainer, device)
        train_s = time.perf_counter() - step_start - data_s
        if cfg.trainer.checkpoint.interval and (step + 1) % cfg.trainer.checkpoint.interval == 0:
            checkpoint(step + 1)
        metrics |= {"sft/epoch": order.epoch(step + 1), "sft/truncated": float(cut), "perf/train_s": train_s,
                    "perf/tokens_per_s": metrics["perf/tokens"] / train_s, "perf/data_s": data_s,
                    "perf/step_s": time.perf_counter() - step_start} | peak_memory(device)
        reporter.report(step, metrics)
        watchdog.progress(f"step {step + 1}")
    checkpoint(cfg.run.max_steps)
    return finish(reporter, watchdog, 0, None)
