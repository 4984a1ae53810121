"""Renders a run's sbatch script: a pure function of the resolved config (no I/O but the template).

    from prl.control.render import render_job
    text = render_job(cfg, python="/shared/venv/bin/python", prl_home="/shared/prl")

Layout: with `slurm.hetjob` one heterogeneous job, component 0 = inference nodes, 1 = trainer nodes,
2 = the orchestrator (when it has its own node); without it one allocation split by node index.
Every value that comes from the user is shell-quoted here; the template only places words. The
script computes the wiring and hands over to prl.run.supervise, which starts each component's srun step
(prl.run.launch builds those; `prl submit --dry-run` shows them).
"""

from __future__ import annotations

import shlex
from functools import lru_cache

import jinja2

from prl.config import ComponentSlurm, Config, component_slurm, envref
from prl.run import protocol
from prl.run.home import PRL_HOME
from prl.run.launch import NODES_ENV
from prl.run.launches import CANCELLED_EXIT
from prl.run.rundir import RunDir, umask_for

TEMPLATES = PRL_HOME / "templates"


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
    if orch is None:  # an SFT job: the trainer's nodes alone
        return [_group_sbatch(component_slurm(cfg, "trainer"), tr.nodes, tr.gpus_per_node, tr.cpus_per_node,
                              "--ntasks-per-node")]
    if cfg.slurm.one_node:
        # One node for all: vLLM's GPUs and the trainer's side by side (prl.run.launch.gpu_slices).
        cpus = (inf.cpus_per_node or 0) + (tr.cpus_per_node or 0)
        return [_group_sbatch(component_slurm(cfg, "trainer"), 1, inf.gpus_per_node + tr.gpus_per_node,
                              cpus + orch.cpus if cpus else None, "--ntasks-per-node")]
    if not cfg.het_groups:
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
    if cfg.het_groups:
        names = ["INFERENCE", "TRAINER"]  # the orchestrator's group needs no list: srun --het-group=2
        return [f"{n}_NODES=($({hostnames.format(f'SLURM_JOB_NODELIST_HET_GROUP_{i}')}))" for i, n in enumerate(names)]
    nodes = {"inference": cfg.inference.nodes, "trainer": cfg.trainer.nodes, "orchestrator": 1}
    sizes = [(name.upper(), nodes[name]) for name in allocated(cfg)]
    lines, start = [f"NODES=($({hostnames.format('SLURM_JOB_NODELIST')}))"], 0
    for name, n in sizes:
        lines.append(f'{name}_NODES=("${{NODES[@]:{start}:{n}}}")')
        start += 0 if cfg.slurm.one_node else n
    return lines


def node_exports(cfg: Config) -> list[str]:
    """Where one allocation is split by node index, each component's nodes for the supervisor's srun
    placement (prl.run.launch.placement); het groups need none (srun --het-group places them)."""
    if cfg.het_groups:
        return []
    var = NODES_ENV.format
    return [f'{var(n)}=$(IFS=,; echo "${{{n}_NODES[*]}}"); export {var(n)}' for n in map(str.upper, allocated(cfg))]


def allocated(cfg: Config) -> list[str]:
    """The components with nodes of their own in the allocation, in its node order (an orchestrator
    placed on the trainer's first node has none)."""
    return [n for n in cfg.components
            if n != "envserver" and (n != "orchestrator" or cfg.orchestrator.placement == "own_node")]


def vllm_data_parallel(cfg: Config) -> bool:
    """One vLLM server over every inference node (inference.multi_node=data_parallel, nodes > 1)."""
    return "inference" in cfg.components and cfg.inference.multi_node == "data_parallel" and cfg.inference.nodes > 1


def wiring_shown(cfg: Config) -> list[str]:
    """The variables job.log lists: the job's wiring by name (an allow-list: a PRL_ or other variable
    that holds a secret, e.g. an API key passed through the environment, is never printed)."""
    names = ["PRL_RUN_DIR", "PRL_HOME", "PRL_PYTHON", "PRL_ATTEMPT", "PRL_LOG_DIR"]
    names += ["PRL_INFERENCE_URLS"] if "inference" in cfg.components else []
    names += ["MASTER_ADDR"]
    names += ["DATA_PARALLEL_ADDRESS", "DATA_PARALLEL_RPC_PORT"] if vllm_data_parallel(cfg) else []
    return names + [NODES_ENV.format(n.upper()) for n in cfg.components if n != "envserver"]


def compile_cache_vars(cfg: Config) -> list[str]:
    """VAR=DIR of each compile cache: in RUN/cache (or run.compile_cache_dir) with run.compile_cache, else in the
    job's scratch."""
    root = f'"${protocol.COMPILE_CACHE_ENV}"' if cfg.run.compile_cache else '"/tmp/prl-$SLURM_JOB_ID"'
    return [f"{var}={root}/{name}" for var, name in protocol.COMPILE_CACHES.items()]


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
        "setup": [_q(envref.shell_line(line, f"slurm.setup[{i}]")) for i, line in enumerate(s.setup)],
        "node_arrays": node_arrays(cfg),
        "node_exports": node_exports(cfg),
        "ports": cfg.inference.ports,  # one per node, or one per replica (inference.replica_servers)
        # inference.multi_node=data_parallel: one endpoint (the first node's); vLLM reads DATA_PARALLEL_*
        "vllm_data_parallel": vllm_data_parallel(cfg),
        "inference_endpoints": ('"${INFERENCE_NODES[0]}"' if vllm_data_parallel(cfg) else '"${INFERENCE_NODES[@]}"')
                               if "inference" in cfg.components else None,
        "log_dirs": " ".join(f'"$PRL_LOG_DIR"/{name}' for name in cfg.components),
        "env": [f"{k}={envref.bash_value(k, v, 'env')}" for k, v in sorted(cfg.env.items())],
        "wiring_shown": "|".join(wiring_shown(cfg)),
        "stop_request": protocol.STOP_REQUEST,
        "compile_cache": _q(cfg.run.compile_cache_dir or RunDir(run_dir).cache) if cfg.run.compile_cache else None,
        "compile_cache_env": protocol.COMPILE_CACHE_ENV,
        "compile_cache_vars": compile_cache_vars(cfg),
        "failed_marker": protocol.FAILED,
        "cancelled_exit": CANCELLED_EXIT,
        "setup_exit": protocol.EXIT_SETUP,
        "umask": f"{umask_for(cfg.run.group_readable):03o}",
    }


def render_job(cfg: Config, *, python: str, prl_home: str) -> str:
    """The batch script for `cfg` (already resolved: absolute paths)."""
    return _environment().get_template("job.sbatch.j2").render(**job_context(cfg, python=python, prl_home=prl_home))


EVAL_SBATCH = ("partition", "account", "qos", "constraint", "mem", "gres")
"""The inference group's batch options that `prl eval`'s array tasks take as they are."""


def eval_array_parameters(cfg: Config) -> dict:
    """submitit's SlurmExecutor parameters for `prl eval`'s job array (prl/control/evaluate.py): per task one
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
    lines = [envref.shell_line(line, f"slurm.setup[{i}]") for i, line in enumerate(cfg.slurm.setup)]
    lines += [envref.shell_line(line, f"inference.slurm.setup[{i}]") for i, line in enumerate(res.setup)]
    setup = [f"{line} || {{ echo {shlex.quote('setup failed: ' + line)} >&2; exit {protocol.EXIT_SETUP}; }}"
             for line in lines]
    env = {"PRL_RUN_DIR": (str(RunDir(cfg.run.run_dir).path), "run"), **{k: (v, "env") for k, v in cfg.env.items()},
           **{k: (v, "inference.env") for k, v in inf.env.items()}}
    setup += [f"export {key}={envref.bash_value(key, value, where)}" for key, (value, where) in sorted(env.items())]
    params = {"job_name": (cfg.slurm.job_name or cfg.run.name) + "-eval", "nodes": 1, "ntasks_per_node": 1,
              "stderr_to_stdout": True, "setup": setup, "srun_args": list(res.srun_args),
              "additional_parameters": sbatch}
    return params | ({"cpus_per_task": inf.cpus_per_node} if inf.cpus_per_node else {})


