"""How each component is started: the one place that builds its command, for srun inside the batch job
and for a local run. Pure functions of the resolved config and the job's wiring; nothing is run here.

    from prl.run.launch import srun_plan, Wiring
    srun_plan(cfg, Wiring.symbolic())     # what `prl submit --dry-run` prints and tests/golden/*.launch holds

Every component runs under prl.run.node (which clears what an earlier job of the run left on its node and
ends whatever the component leaves behind); the trainer runs under torchrun, one rank per GPU.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from prl.config import Config, component_slurm, envref
from prl.run import protocol
from prl.run.attempt import Attempt

NODES_ENV = "PRL_{}_NODES"
"""A component's nodes, comma-separated: the batch script exports them (from SLURM's node list) where
one allocation is split by node index (slurm.hetjob=false); the supervisor places each srun with them."""


def entry(cfg: Config, name: str, home: str) -> list[str]:
    """The component's program under jobs/ (the probe stand-in for all three in probe mode)."""
    return [f"{home}/jobs/{protocol.BY_NAME[name].entry}"] if cfg.run.mode == "train" else [f"{home}/jobs/probe.py", name]


def program(cfg: Config, name: str, *, python: str, home: str, config: str, node_rank: str, endpoint: str,
            rdzv_id: str | None = None) -> list[str]:
    """The component's command line. For torchrun components (the trainer): one rank per GPU on each
    of its nodes, `node_rank` this node's place, `endpoint` the static rendezvous (rank 0's node; port
    0: one rank 0 picks and records, prl.run.rendezvous, which starts torchrun).
    TERM is not in torchrun's --signals-to-handle: on TERM it would SIGKILL the ranks 30 s later,
    cutting a checkpoint short; the ranks get TERM themselves (prl.run.node hands it to them)."""
    prog = [*entry(cfg, name, home), config]
    if not protocol.BY_NAME[name].torchrun:
        return [python, *prog]
    return [python, "-m", "prl.run.rendezvous", protocol.TORCHRUN_SIGNALS, f"--nnodes={cfg.trainer.nodes}",
            f"--nproc-per-node={max(cfg.trainer.gpus_per_node, 1)}", f"--node-rank={node_rank}",
            "--rdzv-backend=static", f"--rdzv-endpoint={endpoint}", *([f"--rdzv-id={rdzv_id}"] if rdzv_id else []),
            *prog]


def local_command(cfg: Config, name: str, *, python: str, home: str, config: str, endpoint: str) -> list[str]:
    """A local run's component: its program, on this one node."""
    return program(cfg, name, python=python, home=home, config=config, node_rank="0", endpoint=endpoint)


def setup_lines(cfg: Config, name: str) -> list[str]:
    """The component's own setup lines, each `${oc.env:NAME}` as the shell's expansion (prl.config.envref)."""
    return [envref.shell_line(line, f"{name}.slurm.setup[{i}]") for i, line in enumerate(component_slurm(cfg, name).setup)]


def task_command(cfg: Config, name: str) -> list[str]:
    """What srun runs on each of the component's nodes: a shell that runs the component's setup lines,
    then execs its program under prl.run.node. Evaluated in the task, so that setup (module load,
    activation) and the component's own $PRL_PYTHON apply to the program; SLURM_PROCID is the node's
    rank within the one-task-per-node step."""
    setup = setup_lines(cfg, name)
    words = program(cfg, name, python='"$PRL_PYTHON"', home='"$PRL_HOME"', config='"$PRL_RUN_DIR/config.yaml"',
                    node_rank="$SLURM_PROCID", endpoint="$MASTER_ADDR:0", rdzv_id="$SLURM_JOB_ID")
    script = []
    if setup:
        # The lines arrive as the shell's arguments, each quoted once; eval keeps what they define.
        # A failure is this component's first failure (noclobber: the first writer wins, as in
        # prl.run.node): srun's own status can be another node's task, killed by --kill-on-bad-exit
        # before its setup failed too (143 instead of 15).
        record = (f'(set -C; echo "{name} {protocol.EXIT_SETUP} $(hostname)" > "$PRL_LOG_DIR/{protocol.FIRST_FAILURE}") '
                  "2>/dev/null")
        script.append(f'for line in "$@"; do eval "$line" || {{ echo "{name} setup failed: $line" >&2; '
                      f"{record}; exit {protocol.EXIT_SETUP}; }}; done")
    script.append(f'exec "$PRL_PYTHON" -m prl.run.node {name} -- ' + " ".join(words))
    return ["bash", "-c", "; ".join(script), name, *setup]


@dataclass(frozen=True)
class Wiring:
    """What the batch script computed from SLURM's node lists, as the supervisor finds it."""
    log_dir: str
    master_addr: str
    nodes: Mapping[str, str]
    """Component -> its nodes, comma-separated (only where one allocation is split: hetjob=false)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Wiring:
        nodes = {name: env[NODES_ENV.format(name.upper())] for name in protocol.NAMES
                 if NODES_ENV.format(name.upper()) in env}
        return cls(log_dir=env["PRL_LOG_DIR"], master_addr=env["MASTER_ADDR"], nodes=nodes)

    @classmethod
    def symbolic(cls) -> Wiring:
        """The job's variables by name: for --dry-run and the golden files."""
        return cls(log_dir="$PRL_LOG_DIR", master_addr="$MASTER_ADDR",
                   nodes={n: "$" + NODES_ENV.format(n.upper()) for n in protocol.NAMES})


def placement(cfg: Config, name: str, wiring: Wiring) -> list[str]:
    """srun options that put a component on its nodes. The envserver goes where the orchestrator goes,
    overlapping its step: the orchestrator reaches it through a unix socket, which only works on one node."""
    if name == "envserver":
        where = [o for o in placement(cfg, "orchestrator", wiring) if o not in ("--overlap", "--mem=0")]
        return [*where, "--overlap", "--mem=0"]
    comp = protocol.BY_NAME[name]
    if cfg.slurm.one_node and name != "orchestrator":
        # Every step overlaps the others on the one node (CPUs, memory, GPUs); each takes its own GPUs
        # out of the allocation's through PRL_GPU_SLICE (gpu_slices, prl.run.node).
        return ["--nodes=1", "--ntasks=1", "--overlap", f"--nodelist={wiring.nodes[name]}"]
    nodes = {"inference": cfg.inference.nodes, "trainer": cfg.trainer.nodes, "orchestrator": 1}[name]
    if name == "orchestrator" and cfg.orchestrator.placement == "trainer_node":
        # The orchestrator is light; it runs next to trainer rank 0 and must overlap that step, which
        # holds all of the node's memory: --mem=0 lets it share that memory instead of asking for more.
        where = ["--het-group=1"] if cfg.het_groups else []
        return [*where, "--nodes=1", "--ntasks=1", "--overlap", "--mem=0", f"--nodelist={wiring.master_addr}"]
    # --ntasks explicitly: a step otherwise inherits the allocation's SLURM_NTASKS.
    per_node = [f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1"]
    if cfg.het_groups:
        return [f"--het-group={comp.het_group}", *per_node]
    return [*per_node, f"--nodelist={wiring.nodes[name]}"]


def gpu_slices(cfg: Config) -> dict[str, str]:
    """FIRST:COUNT of the allocation's GPUs per component in the one-node layout: vLLM the first
    inference.gpus_per_node, the trainer the next trainer.gpus_per_node; none elsewhere."""
    if not cfg.slurm.one_node:
        return {}
    n_inf, n_tr = cfg.inference.gpus_per_node, cfg.trainer.gpus_per_node
    return {name: f"{first}:{count}" for name, first, count in (("inference", 0, n_inf), ("trainer", n_inf, n_tr))
            if count}


def beside_cpu_vllm(cfg: Config, env: Mapping[str, str], local: bool = False) -> dict[str, str]:
    """The trainer's OpenMP threads where it shares its node with vLLM on CPU (local mode, or
    slurm.one_node with inference.gpus_per_node=0): one per rank, as torchrun already gives each of
    several ranks on a node. vLLM's engine takes every core but one there
    (prl.inference.server.cpu_engine_environment), and torch's default, a thread per core in every
    rank, made the two fight for the cores: the toy run's median step took 1.80 s instead of 1.38 s,
    and the run 152 s of CPU instead of 129 s, with the same losses (2-core VM;
    benchmarks/reports/cpu-defaults-toy-run_cpu2_2026-11-26.md).
    An OMP_NUM_THREADS in the job's `env` section or in `env` (the trainer's environment as built so
    far: trainer.env, and in local mode the caller's environment) wins."""
    shared = "inference" in cfg.components and cfg.inference.gpus_per_node == 0 and (local or cfg.slurm.one_node)
    taken = "OMP_NUM_THREADS" in env or "OMP_NUM_THREADS" in cfg.env
    return {"OMP_NUM_THREADS": "1"} if shared and not taken else {}


def component_env(cfg: Config, name: str, batch_python: str) -> dict[str, str]:
    """The component's own environment on top of the job's: its `env` section, its GPU slice (the
    one-node layout), its threads beside a CPU vLLM (beside_cpu_vllm), and its interpreter where it
    differs from the batch script's."""
    res = component_slurm(cfg, name)
    env = {k: str(v) for k, v in cfg.section(name).env.items()}
    if name in (slices := gpu_slices(cfg)):
        env[protocol.GPU_SLICE_ENV] = slices[name]
    if name == "trainer":
        env |= beside_cpu_vllm(cfg, env)
    return env | ({"PRL_PYTHON": res.python} if res.python and res.python != batch_python else {})


def srun_command(cfg: Config, name: str, wiring: Wiring) -> list[str]:
    """The whole srun command line of one component inside the batch job."""
    out = Attempt(Path(wiring.log_dir)).node_output(name)  # "$PRL_LOG_DIR" stays a name when only shown
    return ["srun", *placement(cfg, name, wiring), *component_slurm(cfg, name).srun_args,
            "--kill-on-bad-exit=1", f"--output={out}", *task_command(cfg, name)]


def srun_plan(cfg: Config, wiring: Wiring, batch_python: str = "$PRL_PYTHON") -> str:
    """Every component's srun line as a person reads it (--dry-run, golden files): environment, command."""
    lines = []
    for name in cfg.components:
        env = [f"{k}={v}" for k, v in sorted(component_env(cfg, name, batch_python).items())]
        lines.append(f"{name}: {shlex.join([*env, *srun_command(cfg, name, wiring)])}")
    return "\n".join(lines) + "\n"

