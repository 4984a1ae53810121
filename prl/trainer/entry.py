"""The trainer program's start (jobs/trainer.py): the run's config chooses the RL loop
(prl.trainer.train) or, with an `sft:` section, the SFT job's (prl.trainer.sft)."""

from __future__ import annotations

from prl.config import load_config
from prl.run.diskfull import reporting_disk_full
from prl.run.rundir import RunDir
from prl.trainer.sft import train_sft
from prl.trainer.train import train


def main(config_path: str) -> int:
    cfg = load_config(config_path)
    rd = RunDir.of(cfg)
    with reporting_disk_full("trainer", rd):
        return (train_sft if cfg.sft is not None else train)(cfg, rd)
