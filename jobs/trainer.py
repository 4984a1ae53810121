"""Trainer entry point, one process per GPU (CPU: one per node):

    torchrun --nproc-per-node N jobs/trainer.py RUN/config.yaml [--resume-step N]

Exits 0 when run.max_steps are done, 42 (prl.protocol.RANK_EXIT_PREEMPTED) after a SIGUSR1/SIGTERM
checkpoint.
"""

import argparse
import sys

from prl.trainer.train import main

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", help="the resolved RUN/config.yaml")
    parser.add_argument("--resume-step", type=int, default=None, help="resume from checkpoints/step_N (default: newest complete)")
    args = parser.parse_args()
    sys.exit(main(args.config, args.resume_step))
