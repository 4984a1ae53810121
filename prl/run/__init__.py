"""The run protocol: the run directory, the lifecycle, the contracts between the three programs.

    protocol.py       the three components, their exit statuses and marker files
    rundir.py         the run directory's paths: the only state of a run
    launches.py       each launch: the records of its jobs, its attempt directory
    rewind.py         what a run continuing from a checkpoint drops and archives
    attempt.py        one launch of a run: `logs/attempt_N`
    fence.py          which attempt writes the run: one at a time, the newest launch's
    batch.py          the batch contract between the orchestrator and the trainer
    packing.py        samples -> the trainer's micro-batches
    broadcast.py      policy weights by broadcast, trainer rank 0 -> every vLLM worker
    broadcast_store.py  the broadcast's store: where it listens, its keys signed and kept in place
    lora.py           LoRA adapter versions folded into full weights
    secret.py         the run's secret, which every request to its servers carries
    proof.py          a server's proof that it holds the secret, asked before a client sends it
    launch.py         how each component is started (srun in the job, processes locally)
    supervise.py      the run's lifecycle, written once: start, watch, end the attempt
    node.py           one component on one node: clear what an earlier job left, run, clean up
    rendezvous.py     torchrun, its rendezvous store on rank 0's address at a port picked per attempt
    procs.py          processes by PID, never by name
    watchdog.py       deadlines and the progress watchdog: no silent hangs
    diskfull.py       a full disk ends the run with one clear line
    files.py          files readers see whole or not at all, also through a crash
    log.py            logging for the components: stderr and the per-rank log file
    home.py           where prl's shipped files live: jobs/, templates/, configs/
    ports.py          free TCP ports, and listeners bound to the address the run is reached at
"""
