"""Orchestrator entry point, one process per run (CPU only):

    python jobs/orchestrator.py RUN/config.yaml

Needs PRL_INFERENCE_URLS (comma-separated http://host:port/v1); the run directory is PRL_RUN_DIR,
else the config's. It goes on from the run's newest complete checkpoint, as the trainer does (`prl
resume --step N` rewinds the run directory to an older one before it submits). Exits 0 after
writing rollouts/step_N.pt for every N < run.max_steps, 16 (prl.run.protocol.EXIT_STALLED) when the
servers are not ready or no batch comes in time (`stalled`).
"""

import argparse
import asyncio
import sys

from prl.config import load_config
from prl.run.diskfull import reporting_disk_full
from prl.run.log import setup_logging
from prl.run.rundir import RunDir
from prl.run.watchdog import Watchdog


def main(config_path: str) -> int:
    cfg = load_config(config_path)
    log_file = setup_logging("orchestrator")
    watchdog = Watchdog.start(cfg.watchdog, "orchestrator", dump_to=log_file)
    # Imported after logging is set up: verifiers and torch take seconds to import.
    from prl.orchestrator.loop import run

    rd = RunDir.of(cfg)
    with reporting_disk_full("orchestrator", rd):
        asyncio.run(run(cfg, rd, watchdog))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the resolved RUN/config.yaml")
    args = parser.parse_args()
    sys.exit(main(args.config))
