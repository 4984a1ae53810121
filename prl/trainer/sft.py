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

import time

import torch
import torch.distributed as dist
from loguru import logger

from prl.config import Config, TrainerConfig
from prl.run.log import setup_logging
from prl.run.packing import pack_batch
from prl.run.rundir import RunDir, is_complete
from prl.trainer.ckpt import checkpoint_due, load_newest, save_checkpoint
from prl.trainer.export import adapter_of, model_source_dir, save_weights, weights_dir
from prl.trainer.metrics import StepReporter
from prl.trainer.model import build_model
from prl.trainer.rank import Rank, all_reduce, peak_memory, preempted, rank_number
from prl.trainer.samples import count_tokens, to_device
from prl.trainer.sft_data import DataOrder, load_rows, tokenize
from prl.trainer.stop import StopFlag
from prl.trainer.train import accumulate, build_optimizer, optimizer_step


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


class SftTrainer:
    """The SFT loop on this rank: the data, the policy it trains, the checkpoints it writes. Made
    ready for its first step (data, model, resume); `run` is the story."""

    def __init__(self, cfg: Config, rd: RunDir, rank: Rank, stop: StopFlag):
        from transformers import AutoTokenizer

        self.cfg, self.rd, self.rank, self.stop = cfg, rd, rank, stop
        self.tokenizer = AutoTokenizer.from_pretrained(cfg.model.name,
                                                       trust_remote_code=cfg.model.trust_remote_code)
        self.rows = load_rows(cfg.sft)
        self.order = DataOrder(len(self.rows), cfg.sft.batch_size, cfg.run.seed, cfg.sft.shuffle)
        logger.info(f"SFT: {len(self.rows)} conversations from {cfg.sft.data}, {cfg.sft.batch_size} per step, "
                    f"rank {rank.number}/{rank.world_size} on {rank.device}, run dir {rd.path}")
        # Temperature 1: the data's own distribution.
        self.model = build_model(cfg.model, cfg.trainer, 1.0, rank.device)
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg.trainer, rank.device)
        self.start = load_newest(rd, self.model, self.optimizer, self.scheduler, None)
        rank.reporter = StepReporter(cfg, rd, rank.number)
        self.source = model_source_dir(cfg.model.name)
        rank.watchdog.progress(f"step {self.start}")

    def run(self) -> int:
        """Each step: unless asked to stop, train on the step's rows, checkpoint when due, report. Then
        the run's last checkpoint: 0; or, asked to stop, a checkpoint where it stopped (rank.preempted)."""
        cfg, device = self.cfg, self.rank.device
        for step in range(self.start, cfg.run.max_steps):
            # Decided together: every rank takes the same branch.
            stopping, = all_reduce([self.stop.requested], device, dist.ReduceOp.MAX)
            if stopping:
                return preempted(step, self.stop, self.checkpoint)
            step_start = time.perf_counter()
            per_rank, cut = step_micro_batches(self.tokenizer, self.rows, self.order, step, cfg)
            data_s = time.perf_counter() - step_start
            metrics = sft_step(self.model, self.optimizer, self.scheduler, per_rank[self.rank.number], cfg.trainer,
                               device)
            train_s = time.perf_counter() - step_start - data_s
            if checkpoint_due(cfg.trainer.checkpoint, step + 1):
                self.checkpoint(step + 1)
            metrics |= {"sft/epoch": self.order.epoch(step + 1), "sft/truncated": float(cut),
                        "perf/train_s": train_s, "perf/tokens_per_s": metrics["perf/tokens"] / train_s, "perf/data_s": data_s,
                        "perf/step_s": time.perf_counter() - step_start} | peak_memory(device)
            self.rank.reporter.report(step, metrics)
            self.rank.watchdog.progress(f"step {step + 1}")
        self.checkpoint(cfg.run.max_steps)
        return 0

    def checkpoint(self, step: int) -> None:
        """The full state, and the weights an RL run or `prl eval` can start from (with adapters:
        folded into the base weights)."""
        cfg, keep = self.cfg, self.cfg.trainer.checkpoint.keep_last
        save_checkpoint(self.rd, step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                        keep_last=keep)
        if not is_complete(weights_dir(self.rd, step)):
            save_weights(self.model, getattr(torch, cfg.model.dtype), self.source, self.rd, step, keep,
                         adapter=adapter_of(cfg, folded=True))


def train_sft(cfg: Config, rd: RunDir) -> int:
    """The SFT trainer rank, start to end; its exit status. Its teardown is Rank's, as the RL loop's."""
    stop = StopFlag()
    rank_log = setup_logging("trainer", rank_number())
    with Rank.start(cfg, rank_log, "rendezvous, data, model load and resume") as rank:
        return SftTrainer(cfg, rd, rank, stop).run()
