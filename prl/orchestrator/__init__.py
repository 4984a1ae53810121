"""The orchestrator: rollouts from the vLLM servers, rewards from a verifiers environment, batches for the trainer.

    python jobs/orchestrator.py RUN/config.yaml

`loop.run` is the story; the pieces: `data` (environments + data order), `client` (servers, weight
updates), `rollouts` (groups -> samples + metrics), `advantages`, `trajectory` (a rollout -> one sample;
packed by prl.run.packing; the batch file itself is prl.run.batch's), `progress` (run-directory bookkeeping: resume, weights, the data
order each batch carries) and `evals` (online evals, and what `prl eval` runs on saved weights).
"""
