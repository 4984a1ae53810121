"""The orchestrator: rollouts from the vLLM servers, rewards from a verifiers environment, batches for the trainer.

    python jobs/orchestrator.py RUN/config.yaml

`loop.run` is the story; the pieces: `data` (environments + data order), `client` (servers, weight
updates), `rollouts` (groups -> samples + metrics), `advantages`, `packing` (the batch format of
docs/architecture.md), `progress` (run-directory bookkeeping: resume, weights, orchestrator.json) and
`evals` (online evals, and what `prl eval` runs on saved weights).
"""
