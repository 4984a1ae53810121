"""The top-level `slurm` section, the components' own `slurm` sections, and how the two combine
(component_slurm: an unset key takes the top-level value)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prl.config.common import _check, _single_line
from prl.config.validate import check_printable, check_sbatch_option, check_slurm_time


# Keys a component's `slurm` section may set; None there means the top-level `slurm` value.
INHERITED = ("partition", "account", "qos", "time", "constraint", "mem", "gpu_type", "gres", "exclusive",
             "extra_sbatch", "srun_args", "python")
BATCH_KEYS = INHERITED[:-2]
"""The #SBATCH options of one het group (the rest are srun-level)."""


def _check_batch_options(section: Any, path: str) -> None:
    """Checks shared by `slurm` and the components' `slurm` sections; `path` names the section."""
    for name in ("partition", "account", "qos", "time", "constraint", "mem", "gpu_type", "gres", "python"):
        _single_line(getattr(section, name), f"{path}.{name}")
        _check('"' not in (getattr(section, name) or ""), f"{path}.{name}", "must not contain '\"'")
    for key in ("extra_sbatch", "srun_args"):
        for i, line in enumerate(getattr(section, key) or []):
            _single_line(line, f"{path}.{key}[{i}]")
            _check(line.startswith("-"), f"{path}.{key}[{i}]", f"must be an option starting with '-', got {line!r}")
            check_sbatch_option(line, f"{path}.{key}[{i}]")
    if section.time:
        check_slurm_time(section.time, f"{path}.time")
    if section.mem:
        check_sbatch_option(f"--mem={section.mem}", f"{path}.mem")
    for i, line in enumerate(section.setup):
        _single_line(line, f"{path}.setup[{i}]")
    _check(section.python != "", f"{path}.python", "must be an interpreter path (leave it unset for the default)")


@dataclass(kw_only=True)
class SlurmConfig:
    partition: str | None = None
    """Partition (-p); None: the cluster default."""
    account: str | None = None
    """Account (-A)."""
    qos: str | None = None
    """Quality of service (--qos)."""
    time: str = "01:00:00"
    """Wall-clock limit per attempt (--time)."""
    constraint: str | None = None
    """Node features (--constraint)."""
    mem: str | None = None
    """Memory per node (--mem), e.g. 64G; "0": all of it; None: the partition's default."""
    gpu_type: str | None = None
    """GPU type, giving --gpus-per-node=TYPE:N (e.g. h100) where a cluster needs it."""
    gres: str | None = None
    """Other generic resources per node (--gres), e.g. nvme:1 (GPUs come from gpus_per_node)."""
    exclusive: bool = True
    """Whole nodes per component; keeps components on distinct nodes."""
    extra_sbatch: list[str] = field(default_factory=list)
    """Extra `#SBATCH` options of every het group, e.g. `--mail-type=END`."""
    srun_args: list[str] = field(default_factory=list)
    """Extra srun options of every component, e.g. `--container-image=/shared/prl.sqsh` (pyxis).
    Passed literally (quoted), so use absolute paths, not shell variables."""
    python: str | None = None
    """Interpreter on the compute nodes (with prl installed): runs the batch script's bookkeeping and
    the components; None: the interpreter that ran `prl submit`."""
    setup: list[str] = field(default_factory=list)
    """Shell lines the batch script runs once, after its output goes to the attempt's job.log and
    before any component (module load, venv activation); a failing line ends the job with status 15,
    one that does not parse (`bash -n`) is refused at submit. They run in the run directory (paths
    relative to where you submitted: "$SLURM_SUBMIT_DIR"/...); `${oc.env:NAME}` in one is the shell's
    ${NAME}, read on the node. Lines for a component's own nodes go under `<component>.slurm.setup`."""
    signal_lead_s: int = 300
    """Seconds before the time limit at which SLURM sends USR1 (the trainer checkpoints)."""
    max_requeues: int = 3
    """How often the job may requeue itself after a time-limit warning (preemptions are not counted)."""
    hetjob: bool = True
    """One heterogeneous job (one component per het group); false: one allocation split by node."""
    one_node: bool = False
    """All components on one node of one allocation (needs hetjob=false, one inference and one trainer
    node, orchestrator.placement=trainer_node): the job asks for inference.gpus_per_node +
    trainer.gpus_per_node GPUs, vLLM gets the first of them, the trainer the next ones."""
    job_name: str | None = None
    """Job name; default: run.name."""
    fabric_isolated: bool = False
    """Whether nobody but this job's user reaches the job's nodes over their network (a private
    partition, a fabric of its own). Needed for what prl cannot authenticate: vLLM's multi-node
    data-parallel sockets (inference.multi_node=data_parallel over several nodes), which take any
    client that reaches them; false refuses that layout at submit. prl's own listeners need no such
    trust (docs/security.md)."""

    def __post_init__(self) -> None:
        _check_batch_options(self, "slurm")
        _single_line(self.job_name, "slurm.job_name")
        check_printable(self.job_name, "slurm.job_name")  # squeue shows it to every user
        _check('"' not in (self.job_name or ""), "slurm.job_name", "must not contain '\"'")
        _check(self.signal_lead_s >= 0, "slurm.signal_lead_s", "must be >= 0")
        _check(self.max_requeues >= 0, "slurm.max_requeues", "must be >= 0")


@dataclass(kw_only=True)
class ComponentSlurm:
    """One component's batch and launch options (`inference.slurm`, `trainer.slurm`,
    `orchestrator.slurm`): what its het group asks of SLURM and how its tasks start. A key left
    unset (None) takes the top-level `slurm` value; "" unsets a string there (e.g. partition: the
    cluster default). Checked by the owning section, which knows the key path."""

    partition: str | None = None
    """Partition of this component's het group, e.g. a CPU partition for the orchestrator."""
    account: str | None = None
    """Account (-A)."""
    qos: str | None = None
    """Quality of service (--qos)."""
    time: str | None = None
    """Wall-clock limit (--time)."""
    constraint: str | None = None
    """Node features (--constraint)."""
    mem: str | None = None
    """Memory per node (--mem)."""
    gpu_type: str | None = None
    """GPU type for --gpus-per-node=TYPE:N."""
    gres: str | None = None
    """Other generic resources per node (--gres)."""
    exclusive: bool | None = None
    """Whole nodes (--exclusive)."""
    extra_sbatch: list[str] | None = None
    """Extra #SBATCH options of this het group (replace the top-level list)."""
    srun_args: list[str] | None = None
    """Extra srun options of this component, e.g. its container (replace the top-level list)."""
    python: str | None = None
    """Interpreter of this component's program, e.g. the one inside its container."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run on each of this component's nodes, in the shell that then execs its program
    (module load, conda activate); not inherited. A failing line ends the task with status 15."""


