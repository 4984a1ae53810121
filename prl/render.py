"""Renders a run's sbatch script: a pure function of the resolved config (no I/O but the template).

    from prl.render import render_job
    text = render_job(cfg, python="/shared/venv/bin/python", prl_home="/shared/prl")

Layout: with `slurm.hetjob` one heterogeneous job, component 0 = inference nodes, 1 = trainer nodes,
2 = the orchestrator (when it has its own node); without it one allocation split by node index.
Every value that comes from the user is shell-quoted here; the template only places words.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass
from functools import lru_cache

import jinja2

from prl import protocol
from prl.config import ComponentSlurm, Config, component_slurm
from prl.home import PRL_HOME
from prl.rundir import CANCELLED_EXIT, RunDir

TEMPLATES = PRL_HOME / "templates"


@dataclass(frozen=True)
class Component:
    name: str
    """inference, trainer or orchestrator."""
    srun: list[str]
    """srun options, already quoted."""
    command: str
    """What each srun task runs, as one shell string."""
    env: list[str]
    """`KEY=value` words for `env`, already quoted."""


def _q(value: object) -> str:
    return shlex.quote(str(value))


def _sbatch_value(value: object) -> str:
    """A #SBATCH value: sbatch splits these lines itself and honours double quotes only."""
    s = str(value)
    if s and not any(c in s for c in " \t'\"\\#"):
        return s
    if '"' in s:
        raise ValueError(f"a double quote cannot be passed in an #SBATCH line: {s!r}")
    return f'"{s}"'


# #SBATCH options that take a component's value as it is (None or "": not given).
_SBATCH_VALUES = {"partition": "--partition", "account": "--account", "qos": "--qos", "time": "--time",
                  "constraint": "--constraint", "mem": "--mem", "gres": "--gres"}


def _group_sbatch(res: ComponentSlurm, nodes: int, gpus: int, cpus: int | None, ntasks: str) -> list[str]:
    """One het group's #SBATCH options from its resolved slurm section."""
    opts: dict[str, object] = {"--nodes": nodes, ntasks: 1}
    opts |= {"--gpus-per-node": f"{res.gpu_type}:{gpus}" if res.gpu_type else gpus} if gpus else {}
    opts |= {"--cpus-per-task": cpus} if cpus else {}
    opts |= {flag: getattr(res, key) for key, flag in _SBATCH_VALUES.items() if getattr(res, key)}
    lines = [f"{k}={_sbatch_value(v)}" for k, v in sorted(opts.items())]
    lines += ["--exclusive"] if res.exclusive else []
    return lines + list(res.extra_sbatch)


def sbatch_groups(cfg: Config) -> list[list[str]]:
    """Per-component #SBATCH options (one list per het group, or one list for the fallback)."""
    inf, tr, orch = cfg.inference, cfg.trainer, cfg.orchestrator
    if not cfg.slurm.hetjob:
        # One allocation: the config check made every component's batch options equal.
        nodes = inf.nodes + tr.nodes + (orch.placement == "own_node")
        cpus = max(inf.cpus_per_node or 0, tr.cpus_per_node or 0, orch.cpus) or None
        gpus = max(inf.gpus_per_node, tr.gpus_per_node)
        return [_group_sbatch(component_slurm(cfg, "trainer"), nodes, gpus, cpus, "--ntasks-per-node")]
    groups = [
        _group_sbatch(component_slurm(cfg, "inference"), inf.nodes, inf.gpus_per_node, inf.cpus_per_node, "--ntasks-per-node"),
        _group_sbatch(component_slurm(cfg, "trainer"), tr.nodes, tr.gpus_per_node, tr.cpus_per_node, "--ntasks-per-node"),
    ]
    if orch.placement == "own_node":
        groups.append(_group_sbatch(component_slurm(cfg, "orchestrator"), 1, 0, orch.cpus, "--ntasks"))
    return groups


def node_arrays(cfg: Config) -> list[str]:
    """Bash lines defining INFERENCE_NODES, TRAINER_NODES (and ORCHESTRATOR_NODES) from SLURM's lists."""
    hostnames = 'scontrol show hostnames "${}"'
    orch_own = cfg.orchestrator.placement == "own_node"
    if cfg.slurm.hetjob:
        names = ["INFERENCE", "TRAINER"]  # the orchestrator's group needs no list: srun --het-group=2
        return [f"{n}_NODES=($({hostnames.format(f'SLURM_JOB_NODELIST_HET_GROUP_{i}')}))" for i, n in enumerate(names)]
    sizes = [("INFERENCE", cfg.inference.nodes), ("TRAINER", cfg.trainer.nodes)] + ([("ORCHESTRATOR", 1)] if orch_own else [])
    lines, start = [f"NODES=($({hostnames.format('SLURM_JOB_NODELIST')}))"], 0
    for name, n in sizes:
        lines.append(f'{name}_NODES=("${{NODES[@]:{start}:{n}}}")')
        start += n
    return lines


def _placement(cfg: Config, name: str) -> list[str]:
    """srun options that put a component on its nodes."""
    group = protocol.BY_NAME[name].het_group
    nodes = {"inference": cfg.inference.nodes, "trainer": cfg.trainer.nodes, "orchestrator": 1}[name]
    shares_trainer = name == "orchestrator" and cfg.orchestrator.placement == "trainer_node"
    if shares_trainer:
        # The orchestrator is light; it runs next to trainer rank 0 and must overlap that step, which
        # holds all of the node's memory: --mem=0 lets it share that memory instead of asking for more.
        where = ["--het-group=1"] if cfg.slurm.hetjob else []
        return [*where, "--nodes=1", "--ntasks=1", "--overlap", "--mem=0", '--nodelist="$MASTER_ADDR"']
    # --ntasks explicitly: a step otherwise inherits the allocation's SLURM_NTASKS.
    per_node = [f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1"]
    if cfg.slurm.hetjob:
        return [f"--het-group={group}", *per_node]
    return [*per_node, f'--nodelist="$(IFS=,; echo "${{{name.upper()}_NODES[*]}}")"']


def _program(cfg: Config, name: str) -> str:
    """The component's program, as the task's shell runs it."""
    entry = f'"$PRL_HOME/jobs/{name}.py"' if cfg.run.mode == "train" else f'"$PRL_HOME/jobs/probe.py" {name}'
    if name != "trainer":
        return f'"$PRL_PYTHON" {entry} "$PRL_RUN_DIR/config.yaml"'
    # SLURM_PROCID is the node's rank within this one-task-per-node step. TERM is not in torchrun's
    # --signals-to-handle: on TERM it would SIGKILL the ranks 30 s later, cutting a checkpoint short;
    # the ranks get SLURM's TERM themselves (prl.node hands it to them) and checkpoint.
    return (
        f'"$PRL_PYTHON" -m torch.distributed.run {protocol.TORCHRUN_SIGNALS} --nnodes={cfg.trainer.nodes} '
        f"--nproc-per-node={max(cfg.trainer.gpus_per_node, 1)} --node-rank=$SLURM_PROCID "
        f'--rdzv-backend=static --rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT --rdzv-id=$SLURM_JOB_ID '
        f"{entry} \"$PRL_RUN_DIR/config.yaml\""
    )


def _command(cfg: Config, name: str, setup: list[str]) -> str:
    """What srun runs on each node: a shell that runs the component's setup lines, then execs its
    program under prl.node. Evaluated in the task, so that setup (module load, activation) and the
    component's own $PRL_PYTHON apply to the program."""
    script = []
    if setup:
        # The lines arrive as the shell's arguments, each quoted once; eval keeps what they define.
        script.append(f'for line in "$@"; do eval "$line" || {{ echo "{name} setup failed: $line" >&2; '
                      f"exit {protocol.EXIT_SETUP}; }}; done")
    # prl.node (with the component's interpreter, after its setup) clears what an earlier job of the
    # run left on the node and ends everything the component leaves behind.
    script.append(f'exec "$PRL_PYTHON" -m prl.node {name} -- ' + _program(cfg, name))
    return " ".join(["bash", "-c", _q("; ".join(script)), name, *map(_q, setup)])


def components(cfg: Config, python: str) -> list[Component]:
    """The srun line of each component; `python` is the batch script's interpreter."""
    envs = {"inference": cfg.inference.env, "trainer": cfg.trainer.env, "orchestrator": cfg.orchestrator.env}
    out = []
    for name in protocol.NAMES:
        res = component_slurm(cfg, name)
        user = [_q(arg) for arg in res.srun_args]
        srun = _placement(cfg, name) + user + ["--kill-on-bad-exit=1", f'--output="$PRL_LOG_DIR/{name}/%N.out"']
        env = dict(envs[name]) | ({"PRL_PYTHON": res.python} if res.python and res.python != python else {})
        words = [_q(f"{k}={v}") for k, v in sorted(env.items())]
        out.append(Component(name=name, srun=srun, command=_command(cfg, name, res.setup), env=words))
    return out


@lru_cache(maxsize=1)
def _environment() -> jinja2.Environment:
    loader = jinja2.FileSystemLoader(str(TEMPLATES))
    return jinja2.Environment(loader=loader, undefined=jinja2.StrictUndefined, keep_trailing_newline=True)


def job_context(cfg: Config, *, python: str, prl_home: str) -> dict:
    """Everything the template places; computed here so the template holds no logic."""
    run_dir = cfg.run.run_dir
    s = cfg.slurm
    python = s.python or python
    job = [f"--job-name={_sbatch_value(s.job_name or cfg.run.name)}",
           f"--output={_sbatch_value(run_dir / 'logs' / 'slurm-%j.out')}",
           "--open-mode=append", "--requeue", f"--signal=B:USR1@{s.signal_lead_s}"]
    return {
        "name": cfg.run.name,
        "run_dir": _q(run_dir),
        "script_path": _q(run_dir / "job.sbatch"),
        "python": _q(python),
        "prl_home": _q(prl_home),
        "sbatch_job": job,
        "sbatch_groups": sbatch_groups(cfg),
        "setup": [_q(line) for line in s.setup],
        "node_arrays": node_arrays(cfg),
        "port": cfg.inference.port,
        # trainer rank 0's handshake store for inference.weight_transfer: broadcast (prl.broadcast)
        "weights_port_env": protocol.WEIGHTS_PORT_ENV if cfg.inference.weight_transfer == "broadcast" else None,
        "env": [f"{k}={_q(v)}" for k, v in sorted(cfg.env.items())],
        "components": components(cfg, python),
        "exit_codes": " ".join(f"[{c.name}]={c.exit_code}" for c in protocol.COMPONENTS),
        "preempted_marker": protocol.PREEMPTED,
        "stop_request": protocol.STOP_REQUEST,
        "stalled_marker": protocol.STALLED,
        "failed_marker": protocol.FAILED,
        "first_failure": protocol.FIRST_FAILURE,
        "ended_marker": protocol.ENDED,
        "cancelled_marker": protocol.CANCELLED,
        "complete_marker": protocol.COMPLETE,
        "cancelled_exit": CANCELLED_EXIT,
        "setup_exit": protocol.EXIT_SETUP,
        "stalled_exit": protocol.EXIT_STALLED,
        "max_steps": cfg.run.max_steps,
        "watchdog_requeue": cfg.watchdog.requeue,
        "watchdog_max_requeues": cfg.watchdog.max_requeues,
        "max_requeues": s.max_requeues,
        "max_requeues_exit": protocol.EXIT_MAX_REQUEUES,
    }


def render_job(cfg: Config, *, python: str, prl_home: str) -> str:
    """The batch script for `cfg` (already resolved: absolute paths)."""
    return _environment().get_template("job.sbatch.j2").render(**job_context(cfg, python=python, prl_home=prl_home))


EVAL_SBATCH = ("partition", "account", "qos", "constraint", "mem", "gres")
"""The inference group's batch options that `prl eval`'s array tasks take as they are."""


def eval_array_parameters(cfg: Config) -> dict:
    """submitit's SlurmExecutor parameters for `prl eval`'s job array (prl/evaluate.py): per task one
    node with the inference group's batch options, its setup lines, and the run's environment."""
    inf, res = cfg.inference, component_slurm(cfg, "inference")
    sbatch: dict[str, object] = {"time": res.time}  # always: submitit's own default is 5 minutes
    if inf.gpus_per_node:
        sbatch["gpus_per_node"] = f"{res.gpu_type}:{inf.gpus_per_node}" if res.gpu_type else inf.gpus_per_node
    sbatch |= {key: getattr(res, key) for key in EVAL_SBATCH if getattr(res, key)}
    sbatch |= {"exclusive": True} if res.exclusive else {}
    for option in res.extra_sbatch:  # "--key=value" or "--flag"
        key, eq, value = option.lstrip("-").partition("=")
        sbatch[key] = value if eq else True
    setup = [f"{line} || {{ echo {shlex.quote('setup failed: ' + line)} >&2; exit {protocol.EXIT_SETUP}; }}"
             for line in [*cfg.slurm.setup, *res.setup]]
    env = {"PRL_RUN_DIR": str(RunDir(cfg.run.run_dir).path), **cfg.env, **inf.env}
    setup += [f"export {key}={shlex.quote(str(value))}" for key, value in sorted(env.items())]
    params = {"job_name": (cfg.slurm.job_name or cfg.run.name) + "-eval", "nodes": 1, "ntasks_per_node": 1,
              "stderr_to_stdout": True, "setup": setup, "srun_args": list(res.srun_args),
              "additional_parameters": sbatch}
    return params | ({"cpus_per_task": inf.cpus_per_node} if inf.cpus_per_node else {})


