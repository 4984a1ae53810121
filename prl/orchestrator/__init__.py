"""The orchestrator: rollouts from the vLLM servers, rewards from a verifiers environment, batches for the trainer.

    python jobs/orchestrator.py RUN/config.yaml

`loop.run` is the story; the batch file itself is prl.run.batch's.

    loop.py           the story: per batch, its policy version on the servers, then rollouts -> batch file
    continuous.py     `orchestrator.continuous`: requests in flight across batches
    policy.py         `Policy` (the version the servers hold, loading the next) and `Launch`
    broadcast_coordinator.py  the orchestrator's side of the weight broadcast
    resume.py         the run directory's side: where to resume, which weights to load
    dataset.py        the training environments and the data order
    v1env.py          a verifiers v1 environment (`api: v1`): its worker behind the classic surface
    v1worker.py       the environment worker, run in the environment's own Python (verifiers v1)
    v1server.py       verifiers v1's environment server for entries with server_workers (the envserver component)
    client.py         the inference servers as the orchestrator sees them
    chat.py           the Chat Completions route to the servers
    tokens.py         the token route: every turn continues from the ids of the turns before it
    http_client.py    POSTs to a server's own JSON routes (/tokenize, /prl/generate)
    rollouts.py       one step's groups: run, score, turn into samples, write the batch
    distill.py        on-policy distillation: the teacher's logprobs of each sample's tokens
    refill.py         dynamic sampling: a step's left-out groups replaced by more prompts
    overlong.py       over-long completions: kept, masked out of the loss, or penalised
    records.py        what the model wrote, as JSON (completion files)
    outcomes.py       what rollouts scored, without a training view: reward, the rubric's metrics, seats
    advantages.py     group-relative advantages (GRPO)
    trajectory.py     a verifiers trajectory -> one training sample, or why it cannot be one
    evals.py          online evals, and what `prl eval` runs on saved weights
    passk.py          pass@k and avg@k of an eval
"""
