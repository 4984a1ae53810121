"""The FSDP2 trainer: consumes `RUN/rollouts/step_N.pt`, writes `RUN/weights/step_{N+1}/`.

    torchrun --nproc-per-node 8 jobs/trainer.py RUN/config.yaml

`train.py` is the loop; `model.py` loads and shards the policy; `loss.py` is the objective;
`data.py` puts micro-batches on the device (the batch file is prl.run.batch's); `weights.py` and `ckpt.py`
write what leaves the trainer.
"""
