"""The orchestrator: rollouts from the vLLM servers, rewards from a verifiers environment, batches for the trainer.

    python jobs/orchestrator.py RUN/config.yaml

`loop.run` is the story; the pieces: `data` (environment + data order), `client` (servers, weight
updates), `rollouts` (groups -> samples + metrics), `advantages`, `packing` (the batch format of
docs/architecture.md) and `progress` (run-directory bookkeeping: resume, weights, orchestrator.json).
"""
