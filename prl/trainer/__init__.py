"""The FSDP2 trainer: consumes `RUN/rollouts/step_N.pt`, writes `RUN/weights/step_{N+1}/`.

    torchrun --nproc-per-node 8 jobs/trainer.py RUN/config.yaml

    entry.py          the program's start: the RL loop, or with an `sft:` section the SFT job's
    train.py          the RL loop: `train` is the story; the step itself
    sft.py            the SFT job's loop
    sft_data.py       SFT data: chat rows -> token samples, and the data order
    rank.py           one rank's life for both loops: deadlines, process group, the one teardown
    stop.py           stop requests: SIGUSR1/SIGTERM or the `stop_requested` file
    model.py          the policy: a causal LM returning per-token logprobs, sharded with FSDP2
    flat.py           one rank without FSDP: flat master weights, gradients, moments (`trainer.flat_params`)
    attention.py      the packed attention's kernel (`trainer.attention`): FA4 as a custom op, torch's varlen
    loss.py           the RL objective (`trainer.loss`)
    optim.py          AdamW for bf16 master weights (`trainer.master_dtype`): stochastic rounding;
                      its moments on the host, streamed through the GPU (`trainer.offload_optimizer`)
    routing.py        a mixture-of-experts policy's routing: expert load, router entropy, the aux loss
    replay.py         routing replay: the MoE routers take vLLM's experts (`trainer.routing_replay`)
    expert_parallel.py  an MoE's experts split over the ranks, tokens to them by all-to-all (`trainer.expert_parallel`)
    behaviour.py      behaviour logprobs recomputed by the trainer
    samples.py        micro-batches on the trainer's side: bounds, device copies, token counts
    prewarm.py        the one-time costs paid before the first batch arrives
    ckpt.py           the full trainer state for resume: `RUN/checkpoints/step_N/`
    export.py         policy versions for inference: `RUN/weights/step_N/`
    staging.py        a pinned host buffer for weight exports
    broadcast_sender.py  rank 0's side of the weight broadcast
    metrics.py        per-step metrics: the log line, metrics.jsonl, W&B
"""
