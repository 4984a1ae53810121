"""The run protocol: the components (three, and an environment server where the config asks for one), and the exit statuses and marker files through which the
batch script, local mode, the programs and the CLI talk to each other.

Render, local mode, the run directory, the trainer and `prl status` all read this table; none of
them spells a component's name, het group or exit status on its own. Imports nothing heavy.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Component:
    name: str
    """inference, trainer or orchestrator: also its log directory under logs/attempt_N."""
    het_group: int
    """Its het group in the batch script (the orchestrator's only when it has its own node)."""
    exit_code: int
    """The job's exit status when this component fails first (shown by sacct and prl status)."""
    torchrun: bool = False
    """Started by torchrun, one rank per GPU; it is the component that checkpoints on request, and
    its exit after a requested checkpoint ends the attempt (prl.run.supervise)."""
    must_stay_up: bool = False
    """A server: its exit, whatever the status, is a failure; once only such components are left, the
    run is complete (prl.run.supervise)."""

    @property
    def entry(self) -> str:
        """Its program under jobs/ (the probe stand-in replaces all three in probe mode)."""
        return f"{self.name}.py"


COMPONENTS = (Component("inference", 0, 11, must_stay_up=True), Component("trainer", 1, 12, torchrun=True),
              Component("orchestrator", 2, 13), Component("envserver", 2, 18, must_stay_up=True))
"""The envserver (verifiers v1's environment server, only in runs with an entry's server_workers > 0) runs
beside the orchestrator, on its node: its het group is the orchestrator's (prl.run.launch.placement)."""
BY_NAME = {c.name: c for c in COMPONENTS}
NAMES = tuple(c.name for c in COMPONENTS)
RL_NAMES = NAMES[:3]
"""The components every RL run starts; the envserver only where an environment entry asks for it
(prl.config.Config.components)."""

TORCHRUN_SIGNALS = "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT"
"""torchrun's own signal handling, without SIGTERM: on TERM torchrun SIGKILLs its ranks 30 s later,
which cuts a checkpoint short. torchrun is started with TERM ignored; the ranks get TERM themselves."""

# Exit statuses of the job (batch script or local supervisor) beyond the components' own.
EXIT_MAX_REQUEUES = 14
"""The trainer checkpointed for a time-limit requeue, but slurm.max_requeues is spent."""
EXIT_SETUP = 15
"""A slurm.setup line or the attempt bookkeeping failed before any component started."""
EXIT_STALLED = 16
"""The progress watchdog or a readiness deadline ended the run (`stalled` names the component)."""
EXIT_REQUEUE_FAILED = 17
"""The trainer checkpointed for a requeue, but `scontrol requeue` failed: `prl resume` continues."""
ENV_SERVERS = "env_servers"
"""JSON {config path of an environment entry: its server's address (ipc://SOCKET)}, written once by the
envserver when every server listens (prl.orchestrator.v1server); the orchestrator's environment workers
wait for it and connect there (prl.orchestrator.v1env)."""
EXIT_MEANINGS = {c.exit_code: f"{c.name} failed" for c in COMPONENTS} | {
    EXIT_MAX_REQUEUES: "max requeues spent", EXIT_SETUP: "setup failed", EXIT_STALLED: "stalled",
    EXIT_REQUEUE_FAILED: "requeue failed"}
"""What `prl status` says of a job's exit status."""
RANK_EXIT_PREEMPTED = 42
"""Every trainer rank's exit status after it saved the checkpoint requested by USR1/TERM."""

CANCELLED = "cancelled"
"""In the run directory, written by `prl cancel` (who, when): no later launch of the run starts until
`prl resume` or `prl submit --resume` removes it."""

# Files in logs/attempt_N (each written whole by one writer; their presence is the message).
COMPLETE = "COMPLETE"
"""In weights/step_N and checkpoints/step_N, written last: without it the directory does not exist."""
PREEMPTED = "preempted"
"""Trainer rank 0, once the requested checkpoint is complete. The script keys on it rather than on
the exit status, which torchrun turns into 1 for any failing rank."""
STOP_REQUEST = "stop_requested"
"""Written by the batch script (or local supervisor) on USR1/TERM (local: INT), one line `SIGNAL time`
per signal; the supervisor reads it (a TERM/INT line: the job is shutting down, not requeued), and the trainer ranks treat it like the
signal (checked with the signal flag at every step boundary and every 0.5 s while waiting for a
batch, agreed by all-reduce), so a request made before the ranks have their signal handlers is not
lost. Its content is for people only."""
FAILED = "failed"
"""Which component failed first and with what status (or why the attempt stalled)."""
STALLED = "stalled"
"""Written by a component whose watchdog or readiness deadline fired, before it exits EXIT_STALLED
(prl.run.watchdog): one line, `<component> rank <R>: <what it waited for>: nothing for <N>s (limit <M>s)`;
the first word is the component. Created once (by the first rank to stall): the component's
other ranks, seeing it, dump their stacks and exit EXIT_STALLED too."""
FIRST_FAILURE = "first_failure"
"""`COMPONENT STATUS HOST`, written by prl.run.node the moment a component's leader dies on its own
(first writer wins): which component failed first, before any cleanup and before the others notice
(an orchestrator whose server vanished fails a second later, but is not the cause)."""
WRITE_FAILED = "write_failed"
"""Written by a component that could not write for want of space or quota (prl.run.diskfull), after
rank 0 removed the run's unfinished files, which makes room for this line: `<component> rank <R>:
<what failed>; <free> MiB free of <total> MiB on the filesystem of RUN`. The supervisor puts it into
FAILED; `prl status` shows it."""
REQUEUED = "requeued"
"""This attempt requeued the job after a time-limit warning (counts against slurm.max_requeues)."""
STALL_REQUEUED = "stall_requeued"
"""This attempt requeued the job after a stall (counts against watchdog.max_requeues)."""
CHECKPOINTS_DONE = "checkpoints_done"
"""Trainer rank 0 appends `step_N` once checkpoint N is complete: which checkpoints each attempt made."""
WEIGHTS_STORE = "weights_store"
"""`HOST:PORT` of trainer rank 0's weight-broadcast store (prl.run.broadcast), written once it listens
on a port the system picked (inference.weight_transfer: broadcast only)."""
RENDEZVOUS = "rendezvous"
"""`HOST:PORT` of torchrun's rendezvous store, written by trainer node rank 0 once it listens on a port
the system picked (prl.run.rendezvous); the trainer's other nodes read it."""
ENDED = "ended"
"""The supervisor's last word on the attempt: why it ended (complete, preempted, failed, ...)."""
LAUNCHED = "launched"
"""When the supervisor started the components (seconds since the epoch): what the `startup/*` metrics
count from (prl.run.attempt.Attempt.since_launch)."""

NODE_RANK_ENV = "PRL_NODE_RANK"
"""A component's node index among its nodes (prl.run.node sets it from SLURM_PROCID; local mode: 0):
the rank of a server's `rank_R.log` (the trainer's ranks use torchrun's RANK)."""
WEIGHTS_BACKEND_ENV = "PRL_WEIGHTS_BACKEND"
"""gloo where trainer and servers share a GPU (local mode on too few GPUs): NCCL refuses two ranks on
one device. Unset: NCCL between GPUs, gloo otherwise (prl.trainer.train.start_broadcast)."""

COMPILE_CACHE_ENV = "PRL_COMPILE_CACHE"
"""RUN/cache, exported by the batch script with run.compile_cache, where the compile caches below
point; prl.run.node moves them to the job's scratch where that directory takes no file lock."""
COMPILE_CACHES = {"TRITON_CACHE_DIR": "triton", "TORCHINDUCTOR_CACHE_DIR": "inductor",
                  "TORCH_EXTENSIONS_DIR": "torch_extensions", "FLASH_ATTENTION_CUTE_DSL_CACHE_DIR": "flash_attn_cute"}
"""The caches of compiled code the components load (variable: directory name under the cache root),
which the batch script points at RUN/cache or the job's node-local scratch, before the config's env.
FlashAttention 4's (trainer.attention) is read only where the trainer turns it on (prl.trainer.attention)."""

LORA_SCALE_ENV = "PRL_LORA_SCALE"
"""alpha / rank of the run's adapters (set by prl.inference.server.export_environment): what a
broadcast adapter version, which arrives without its adapter_config.json, is folded in with."""

STAGING_WORKERS_ENV = "PRL_STAGING_WORKERS"
"""vLLM workers on this node that may each stage a policy version at once (set by
prl.inference.server.export_environment: the node's GPUs, or its CPU replicas): what a worker's
share of the node's available memory is (prl.inference.readahead)."""

GPU_SLICE_ENV = "PRL_GPU_SLICE"
"""FIRST:COUNT of the step's CUDA_VISIBLE_DEVICES that a component uses (the one-node layout, where its
srun step shares the allocation's GPUs with the others); prl.run.node narrows CUDA_VISIBLE_DEVICES."""


REPLICA_ENV = "PRL_INFERENCE_REPLICA"
"""INDEX/COUNT: which of its node's COUNT servers a server process is, with inference.replica_servers
(prl.inference.replicas sets it for each one it starts): its port is inference.port + INDEX, its log
rank_<node x COUNT + INDEX>.log."""

TEACHER_ENV = "PRL_TEACHER"
"""Set (to 1) for the teacher's server process that the inference component starts beside the
policy's (prl.inference.replicas, the `teacher` section): jobs/inference.py then serves the teacher
model on teacher.port (prl.inference.teacher), logging to inference/rank_teacher_R.log, and its
/update_weights refuses every request."""
