"""`prl submit`: validate, resolve, write the run directory, render the job, submit it.

    prl submit configs/hendrycks_math.yaml trainer.nodes=4 slurm.partition=gpu --dry-run

Order matters for "nothing half-submitted": the config is validated, the script rendered and
syntax-checked in memory, and the pre-submit checks (prl.control.checks: output dir, model, environment,
`sbatch --test-only`) run before the run directory is touched; if sbatch then refuses the job, a run
directory created by this call is removed again.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from prl.config import Config, ConfigError, envref, load_config, to_yaml
from prl.config.inference import check_weights_root
from prl.config.run import absolute_output_dir
from prl.control import fork, slurm
from prl.control.checks import check_before_submit, job_environ
from prl.control.render import render_job
from prl.control.runstate import ensure_idle
from prl.control.toolparser import AUTO, resolve_parser
from prl.run import launches, secret
from prl.run.home import PRL_HOME
from prl.run.launch import Wiring, srun_plan
from prl.run.rundir import RunDir, not_own, set_umask


class SubmitError(ValueError):
    """The run cannot be submitted as asked; nothing was written or submitted."""


def resolve(cfg: Config) -> Config:
    """Derived values, computed once: absolute output dir, absolute local model paths (the teacher's too) and SFT data, job
    name, the tool-call parser `auto` stands for (prl.control.toolparser)."""
    run = dataclasses.replace(cfg.run, output_dir=str(absolute_output_dir(cfg.run.output_dir)))
    if run.compile_cache_dir is not None:  # the job's nodes read it: absolute, as on this machine
        run = dataclasses.replace(run, compile_cache_dir=os.path.abspath(os.path.expanduser(run.compile_cache_dir)))
    model = cfg.model
    if not os.path.isabs(model.name) and Path(model.name).is_dir():
        model = dataclasses.replace(model, name=os.path.abspath(model.name))
    slurm_cfg = dataclasses.replace(cfg.slurm, job_name=cfg.slurm.job_name or cfg.run.name)
    sft = cfg.sft
    if sft is not None and not os.path.isabs(sft.data):
        sft = dataclasses.replace(sft, data=os.path.abspath(os.path.expanduser(sft.data)))
    inference = cfg.inference
    if inference.weights_root is not None:  # the job runs in the run directory, not here
        inference = dataclasses.replace(inference, weights_root=os.path.abspath(os.path.expanduser(inference.weights_root)))
    teacher = cfg.teacher  # a local directory named from here, as model.name: the job runs elsewhere
    if teacher is not None and not os.path.isabs(teacher.model) and Path(teacher.model).is_dir():
        teacher = dataclasses.replace(teacher, model=os.path.abspath(teacher.model))
    if inference.tool_call_parser == AUTO and cfg.sft is None:
        parser = resolve_parser(model, job_environ(cfg))
        print(f"inference.tool_call_parser: auto -> {parser} ({model.name})", file=sys.stderr)
        inference = dataclasses.replace(inference, tool_call_parser=parser)
    return dataclasses.replace(cfg, run=run, model=model, slurm=slurm_cfg, sft=sft, inference=inference, teacher=teacher)


def batch_python(cfg: Config) -> str:
    """The batch script's interpreter (slurm.python, else the one running prl submit)."""
    return cfg.slurm.python or sys.executable


def check_script(text: str) -> None:
    """`bash -n` on the rendered script, before anything is written."""
    result = subprocess.run(["bash", "-n", "/dev/stdin"], input=text, capture_output=True, text=True)
    if result.returncode != 0:
        raise SubmitError(f"rendered job script does not parse: {result.stderr.strip()}")


def check_setup_lines(cfg: Config) -> None:
    """`bash -n` on each setup line as the node will eval it: the script's own check sees a quoted
    word, and a line that does not parse (a stray `fi`) would fail only on the node, after the queue."""
    lines = {f"slurm.setup[{i}]": line for i, line in enumerate(cfg.slurm.setup)}
    for name in cfg.components:
        if name == "envserver":
            continue  # the orchestrator's lines
        lines |= {f"{name}.slurm.setup[{i}]": line for i, line in enumerate(cfg.section(name).slurm.setup)}
    for path, line in lines.items():
        result = subprocess.run(["bash", "-n", "-c", envref.shell_line(line, path)], capture_output=True, text=True)
        if result.returncode != 0:
            error = (result.stderr.strip().splitlines() or ["syntax error"])[0].removeprefix("bash: -c: ")
            raise ConfigError(f"{path}: does not parse as a shell line ({error}): {line!r}")


def prepare(config_path: str, overrides: list[str], *, resume: bool, clean: bool,
            local: bool = False) -> tuple[Config, RunDir, str]:
    """Load, resolve, render and check; check the run directory may be (re)used. Writes nothing."""
    cfg = resolve(load_config(config_path, overrides))
    check_setup_lines(cfg)
    if cfg.inference.weights_root is not None:  # at submit: servers started by hand (tests, benchmarks) choose freely
        check_weights_root(cfg.inference.weights_root, [cfg.run.run_dir, *([Path.home()] if "HOME" in os.environ else [])])
    text = render_job(cfg, python=sys.executable, prl_home=str(PRL_HOME))
    check_script(text)
    rd = RunDir(cfg.run.run_dir)
    if has_artifacts(rd) and not (resume or clean):
        raise SubmitError(
            f"{rd.path} already holds a run (logs, checkpoints or submissions); "
            "pass --resume to continue it or --clean to move it aside and start over"
        )
    if has_artifacts(rd):
        # Before anything is written: a live run's config.yaml and job script are never rewritten.
        ensure_idle(rd, "--resume" if resume else "--clean")
    for path in (rd.path, rd.config) if not clean else ():  # --clean moves RUN aside, link or not
        if os.path.lexists(path) and (problem := not_own(path)):
            raise SubmitError(problem)  # what it would write would be another's; every launch refuses it
    check_before_submit(cfg, text, local=local)
    return cfg, rd, text


ARTIFACTS = ("logs", "checkpoints", "weights", "rollouts", "submissions.jsonl", "jobs.jsonl")
"""What a launch or a submit writes into a run directory, beside its config and job script."""


def has_artifacts(rd: RunDir) -> bool:
    """True once anything but the config and script was written (a launch or a submit)."""
    for name in ARTIFACTS:
        p = rd.path / name
        if p.is_file() or (p.is_dir() and any(p.iterdir())):
            return True
    return False


def archive(rd: RunDir) -> Path:
    """Move the whole run directory aside (`--clean`): nothing is deleted."""
    dest = rd.path.with_name(f"{rd.path.name}.prev-{time.strftime('%Y%m%d-%H%M%S')}")
    rd.path.rename(dest)
    return dest


def write_run_dir(cfg: Config, rd: RunDir, text: str, *, clean: bool) -> Path | None:
    """Create (or refresh) the run directory; returns where an old run was moved by --clean."""
    moved = archive(rd) if clean and rd.path.exists() else None
    rd.path.parent.mkdir(parents=True, exist_ok=True)  # run.output_dir is not the run's: the user's umask
    # Others on the cluster read nothing of it, at no moment: this process (and a local run's
    # components, its children) creates under the run's umask from here on.
    set_umask(cfg.run.group_readable)
    rd.create(to_yaml(cfg), text, cfg.run.group_readable)
    secret.ensure(rd.path)  # a resumed run keeps its own; the job finds it here, never in its environment
    rd.cancelled.unlink(missing_ok=True)  # submit --resume continues a cancelled run
    return moved


def submit(config_path: str, overrides: list[str], *, dry_run: bool = False, resume: bool = False,
           clean: bool = False, argv: list[str] | None = None, fork_from: str | None = None) -> tuple[RunDir, str | None]:
    """The whole `prl submit`; returns the run directory and the job id (None for --dry-run).
    `fork_from`: RUN[:STEP], a checkpoint the new run starts from (prl.control.fork)."""
    cfg, rd, text = prepare(config_path, overrides, resume=resume, clean=clean)
    forked = fork.plan(fork_from, cfg, rd) if fork_from else None
    existed = rd.path.exists()
    moved = write_run_dir(cfg, rd, text, clean=clean)
    if forked:
        print(f"starts from {fork.apply(forked, rd)} (linked from {forked.checkpoint})")
    if moved:
        print(f"moved the previous run to {moved}")
    if dry_run:
        print(text, end="")
        print("# The supervisor (prl.run.supervise) starts each component as this srun step; $NAMES are the job's:")
        print("".join(f"#   {line}\n" for line in srun_plan(cfg, Wiring.symbolic(), batch_python(cfg)).splitlines()), end="")
        print(f"# dry run: wrote {rd.path}; submit with: sbatch --parsable {shlex.quote(str(rd.job_script))}")
        return rd, None
    try:
        job_id = slurm.sbatch(str(rd.job_script))
    except slurm.SlurmError:
        if not existed or moved:
            shutil.rmtree(rd.path, ignore_errors=True)
        if moved:
            moved.rename(rd.path)
        raise
    launches.record_submission(rd, job_id, argv or [], kind="resume" if resume else "submit")
    return rd, job_id


__all__ = ["ConfigError", "SubmitError", "prepare", "resolve", "submit"]
