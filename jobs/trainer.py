"""Trainer entry point, one process per GPU (CPU: one per node); the RL loop, or an SFT job's:

    torchrun --nproc-per-node N jobs/trainer.py RUN/config.yaml

Each launch resumes from the run's newest complete checkpoint (`prl resume --step N` rewinds the run
directory to an older one before it submits).

Exits 0 when run.max_steps are done, 42 (prl.run.protocol.RANK_EXIT_PREEMPTED) after a checkpoint asked
for by SIGUSR1/SIGTERM or `$PRL_LOG_DIR/stop_requested`, 16 (prl.run.protocol.EXIT_STALLED) when a
readiness deadline or the progress watchdog fired (`$PRL_LOG_DIR/stalled` says what it waited for).
"""

# First, before torch and the rest (seconds of imports): the ranks start with USR1/TERM ignored.
from prl.trainer import stop

stop.install()

import argparse  # noqa: E402
import sys  # noqa: E402

from prl.trainer.entry import main  # noqa: E402

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the resolved RUN/config.yaml")
    args = parser.parse_args()
    sys.exit(main(args.config))
