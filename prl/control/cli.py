"""The `prl` command: submit, status, cancel, logs, resume, eval (and local runs with `submit --local`).

    prl submit configs/toy.yaml --local                  # the whole run on this machine
    prl submit configs/hendrycks_math.yaml trainer.nodes=4 --dry-run
    prl status [RUN] [--json]   prl cancel [RUN]   prl logs [RUN] [-c trainer] [-r 0] [-f] [--attempt N|all]
    prl resume [RUN] --step 50 [--dry-run]
    prl eval [RUN] [--steps 10,20 | --all] [--local]
    prl runs [DIR]     prl plot [RUN] [-o PNG]     prl watch [RUN] [--stacked] [--plain]
    prl completion bash          prl --version

CONFIG is a YAML file; a shipped config may be named bare from any directory (hendrycks_math.yaml).

Without RUN, a command acts on the run directory that contains the current directory, else on the run
most recently submitted from the current directory (recorded in ./.prl-last-run); it says which.
Without DIR, `prl runs` lists ./outputs, where prl submit puts runs unless run.output_dir says otherwise.
Exit status 2 means bad input (config or arguments); nothing was written or submitted.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from prl.config import ConfigError
from prl.control.submit import SubmitError
from prl.run import launches, protocol, rewind
from prl.run.rundir import RunDir, complete_steps, set_umask

LAST_RUN = ".prl-last-run"


class UsageError(RuntimeError):
    """Bad arguments; exit status 2."""


def find_run(arg: str | None) -> RunDir:
    """The run a command acts on (see the module docstring for the rule). What the command writes into
    it (prl eval's results, logs and array jobs, prl plot, prl cancel) is created under the run's
    umask, as its own processes' (prl.run.rundir.set_umask): the run directory's mode says whether
    its group shares it."""
    rd = _find_run(arg)
    set_umask(group_readable=bool(rd.path.stat().st_mode & 0o050))
    return rd


def _find_run(arg: str | None) -> RunDir:
    if arg is not None:
        rd = RunDir(Path(arg).resolve())
        if not rd.config.is_file():
            raise UsageError(f"{arg}: not a prl run directory (no config.yaml)")
        return rd
    for d in (Path.cwd(), *Path.cwd().parents):
        if RunDir(d).config.is_file() and (d / "job.sbatch").exists():
            print(f"run: {d} (the current directory)", file=sys.stderr)
            return RunDir(d)
    last = Path(LAST_RUN)
    if last.is_file() and RunDir(Path(last.read_text().strip())).config.is_file():
        path = Path(last.read_text().strip())
        print(f"run: {path} (last submitted from here, {LAST_RUN})", file=sys.stderr)
        return RunDir(path)
    raise UsageError("no RUN given, not inside a run directory, and nothing was submitted from here")


def _remember(rd: RunDir) -> None:
    try:
        Path(LAST_RUN).write_text(f"{rd.path}\n")
    except OSError:
        pass  # a read-only cwd must not fail a submission that already happened


def cmd_submit(args: argparse.Namespace) -> int:
    from prl.control import submit
    from prl.run.home import find_config

    args.config = find_config(args.config)

    if args.local:
        from prl.control.local import run_local

        # Remembered before it starts, so `prl status` / `prl cancel` typed here find the run at once.
        return run_local(args.config, args.overrides, resume=args.resume, clean=args.clean, dry_run=args.dry_run,
                         on_start=_remember, fork_from=args.fork_from)
    rd, job_id = submit.submit(args.config, args.overrides, dry_run=args.dry_run, resume=args.resume,
                               clean=args.clean, argv=sys.argv, fork_from=args.fork_from)
    _remember(rd)
    if job_id:
        print(f"submitted job {job_id}\nrun directory: {rd.path}")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from prl.control.status import print_status

    print_status(find_run(args.run), as_json=args.json)
    return 0


def cmd_runs(args: argparse.Namespace) -> int:
    from prl.config.run import absolute_output_dir
    from prl.control.status import print_runs

    parent = Path(args.dir).resolve() if args.dir is not None else absolute_output_dir()
    if not parent.is_dir():
        raise UsageError(f"{parent}: not a directory" if args.dir is not None else
                         f"no DIR given, and {parent} (run.output_dir's default, where prl submit puts runs) "
                         "is not a directory")
    if args.dir is None:
        print(f"runs under {parent} (run.output_dir's default)", file=sys.stderr)
    print_runs(parent, as_json=args.json)
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from prl.control.plot import PlotError, plot_run

    rd = find_run(args.run)
    try:
        out = plot_run(rd, Path(args.output) if args.output else rd.path / "metrics.png")
    except PlotError as e:
        raise UsageError(str(e)) from None
    print(f"wrote {out}")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    from prl.control.watch import watch

    return watch(find_run(args.run), stacked=args.stacked, plain=args.plain, once=args.once)


def cmd_completion(args: argparse.Namespace) -> int:
    from prl.control.completion import bash_script

    print(bash_script(build_parser()), end="")
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    import os
    import signal

    from prl.control import runstate, slurm

    rd = find_run(args.run)
    if (local := runstate.live_local(rd)) is not None:
        # The local supervisor takes TERM like Ctrl-C: the trainer checkpoints, then everything stops.
        os.kill(int(local["pid"]), signal.SIGTERM)
        print(f"asked the local run (pid {local['pid']}) to checkpoint and stop; continue it with: "
              f"prl resume {rd.path}")
        return 0
    try:
        live = runstate.live_jobs(rd)
    except slurm.SlurmUnknown as e:
        raise slurm.SlurmUnknown(f"cannot tell which jobs of {rd.path} are queued or running ({e}); "
                                 "nothing cancelled") from None
    if not live:
        print(f"no queued or running job for {rd.path}")
        return 0
    # Marked first: a requeue racing with scancel then finds the mark and does not start the run.
    rd.cancelled.write_text(launches.cancel_mark(list(live)))
    slurm.scancel(list(live))
    print(f"cancelled {', '.join(live)}; `prl resume {rd.path}` continues the run")
    return 0


def cmd_resume(args: argparse.Namespace) -> int:
    from prl.control import runstate, slurm

    rd = find_run(args.run)
    runstate.ensure_idle(rd, "resume it")
    steps = complete_steps(rd.checkpoints)
    step = args.step if args.step is not None else (steps[-1] if steps else 0)
    if step != 0 and step not in steps:
        raise UsageError(f"step {step} has no complete checkpoint; complete: {', '.join(map(str, steps)) or 'none'}")
    delete, archive = rewind.rewind_plan(rd, step)
    for p in delete:
        print(f"{'would remove' if args.dry_run else 'removing'} {p}")
    for p in archive:
        print(f"{'would archive' if args.dry_run else 'archiving'} {p}")
    if args.dry_run:
        print(f"dry run: would resubmit {rd.job_script} to continue from step {step}")
        return 0
    rewind.rewind(rd, step)
    rd.cancelled.unlink(missing_ok=True)
    job_id = slurm.sbatch(str(rd.job_script))
    launches.record_submission(rd, job_id, sys.argv, kind=f"resume --step {step}")
    print(f"submitted job {job_id}: {rd.path} continues from step {step}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from prl.control import evaluate

    rd = find_run(args.run)
    from prl.config import load_config

    if load_config(rd.config).orchestrator is None:
        raise UsageError(f"{rd.path} is an SFT job: it has no orchestrator.eval to run; evaluate its weights "
                         "from an RL config (model.name=RUN/weights/step_N)")
    saved = complete_steps(rd.weights)
    if args.all:
        steps = saved
    elif args.steps is not None:
        try:
            steps = evaluate.parse_steps(args.steps)
        except ValueError as e:
            raise UsageError(f"--steps: {e}") from None
    else:
        steps = saved[-1:]
    if not steps:
        raise UsageError(f"{rd.weights}: no saved weights to evaluate (--steps 0 evaluates model.name)")
    if missing := evaluate.missing_steps(rd, steps):
        raise UsageError(f"--steps: no saved weights for step {', '.join(map(str, missing))} "
                         f"(saved: {', '.join(map(str, saved)) or 'none'})")
    if args.local:
        return evaluate.run_local(rd, steps)
    job_id = evaluate.submit_array(rd, steps, sys.argv)
    print(f"submitted job array {job_id}: steps {', '.join(map(str, steps))} -> {rd.evals}/step_N.json")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    from prl.control.logview import show_logs

    return show_logs(find_run(args.run), component=args.component, rank=args.rank, attempt=args.attempt,
                     lines=args.lines, follow=args.follow)


class VersionAction(argparse.Action):
    """--version, read from the installed metadata only when asked (importlib.metadata costs ~20 ms)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, help="print prl's version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args, **kwargs) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            text = version("prl")
        except PackageNotFoundError:
            text = "unknown (not installed)"
        print(f"prl {text}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    # The epilog is the docstring's rule for finding RUN: every command below that takes RUN uses it.
    p = argparse.ArgumentParser(prog="prl", description=__doc__.split("\n\n")[0],
                                epilog="\n\n".join(__doc__.split("\n\n")[2:]).strip(),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=VersionAction)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("submit", help="validate a config, write the run directory, submit the job")
    s.add_argument("config", help="YAML config file")
    s.add_argument("overrides", nargs="*", help="key=value overrides (dotted paths; later wins)")
    s.add_argument("--dry-run", action="store_true",
                   help="write everything, print the script (--local: each component's command), submit or start nothing")
    s.add_argument("--local", action="store_true", help="run the three programs on this machine, no SLURM")
    s.add_argument("--resume", action="store_true", help="continue a run directory that has artifacts")
    s.add_argument("--clean", action="store_true", help="move an existing run directory aside and start over")
    s.add_argument("--from", dest="fork_from", metavar="RUN[:STEP]",
                   help="start from another run's checkpoint STEP (default: its newest): weights, optimizer, data position")
    s.set_defaults(func=cmd_submit)

    st = sub.add_parser("status", help="job state, nodes, progress (step k/N, s/step, ETA), checkpoints")
    st.add_argument("run", nargs="?", help=RUN_HELP)
    st.add_argument("--json", action="store_true", help="the same facts as JSON, for scripts")
    st.set_defaults(func=cmd_status)

    c = sub.add_parser("cancel", help="stop the run: cancel its SLURM job, or checkpoint and stop a local run")
    c.add_argument("run", nargs="?", help=RUN_HELP)
    c.set_defaults(func=cmd_cancel)

    ru = sub.add_parser("runs", help="list the runs under an output directory with their state")
    ru.add_argument("dir", nargs="?", help="directory holding run directories (default: ./outputs, "
                    "run.output_dir's default, where prl submit puts runs)")
    ru.add_argument("--json", action="store_true", help="as JSON, for scripts")
    ru.set_defaults(func=cmd_runs)

    rs = sub.add_parser("resume", help="continue a stopped run from a checkpoint (same run id)")
    rs.add_argument("run", nargs="?", help=RUN_HELP)
    rs.add_argument("--step", type=int, help="checkpoint step to continue from (default: the newest)")
    rs.add_argument("--dry-run", action="store_true", help="show what would be removed and resubmitted")
    rs.set_defaults(func=cmd_resume)

    lg = sub.add_parser("logs", help="show per-component, per-rank logs")
    lg.add_argument("run", nargs="?", help=RUN_HELP)
    lg.add_argument("-c", "--component", choices=[*protocol.NAMES, "job"],
                    help="only this component's files (job: the batch script's own log)")
    lg.add_argument("-r", "--rank", type=int, help="only this rank's files")
    lg.add_argument("--attempt", type=_attempt_arg, help="attempt number, or all (default: the newest; with -f, "
                    "also the attempts that start later)")
    lg.add_argument("-n", "--lines", type=int, default=20, help="last lines per file (default 20; 0: all)")
    lg.add_argument("-f", "--follow", action="store_true", help="keep printing new lines and new files")
    lg.set_defaults(func=cmd_logs)

    ev = sub.add_parser("eval", help="evaluate saved weights (orchestrator.eval settings) -> RUN/evals/step_N.json")
    ev.add_argument("run", nargs="?", help=RUN_HELP)
    which = ev.add_mutually_exclusive_group()
    which.add_argument("--steps", help="comma-separated policy versions, e.g. 10,20 (default: the newest saved)")
    which.add_argument("--all", action="store_true", help="every saved weights directory")
    ev.add_argument("--local", action="store_true", help="here, one vLLM server per version in turn (no SLURM)")
    ev.set_defaults(func=cmd_eval)

    pl = sub.add_parser("plot", help="PNG of reward, loss, entropy and step time over steps (all attempts)")
    pl.add_argument("run", nargs="?", help=RUN_HELP)
    pl.add_argument("-o", "--output", help="PNG file to write (default: RUN/metrics.png)")
    pl.set_defaults(func=cmd_plot)

    w = sub.add_parser("watch", help="the three components' newest logs side by side (tmux), following new attempts")
    w.add_argument("run", nargs="?", help=RUN_HELP)
    w.add_argument("--stacked", action="store_true", help="above each other instead of side by side")
    w.add_argument("--plain", action="store_true", help="redraw this terminal instead of using tmux")
    w.add_argument("--once", action="store_true", help="print one plain frame and exit")
    w.set_defaults(func=cmd_watch)

    co = sub.add_parser("completion", help="print a shell completion script: source <(prl completion bash)")
    co.add_argument("shell", choices=["bash"])
    co.set_defaults(func=cmd_completion)
    return p


RUN_HELP = "run directory (default: the one containing the current directory, else ./.prl-last-run)"


def _attempt_arg(text: str) -> int | str:
    if text == "all":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an attempt number or 'all': {text!r}") from None


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def one_line(message: str) -> str:
    """An error as one line: a control character (a newline in a path, an ESC) shown escaped, as repr
    shows it, so the message neither spans lines nor drives the terminal."""
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], message)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    # Overrides may come before or after flags (`prl submit C --dry-run a=1`); argparse alone would
    # not take positionals after an option, so unknown key=value words are overrides.
    args, unknown = parser.parse_known_args(argv)
    stray = [u for u in unknown if u.startswith("-") or args.command != "submit"]
    if stray:
        parser.error(f"unrecognized arguments: {' '.join(stray)}")
    if unknown:
        args.overrides = [*args.overrides, *unknown]
    if getattr(args, "resume", False) and getattr(args, "clean", False):
        print("prl: --resume and --clean exclude each other", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except (ConfigError, UsageError, SubmitError) as e:
        print(f"prl: error: {one_line(str(e))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # `prl logs | head`: the reader is gone; say nothing more (Python would print a traceback
        # when it flushes stdout at exit, so point stdout at /dev/null first).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except RuntimeError as e:  # SlurmError: SLURM could not carry the command out
        print(f"prl: error: {one_line(str(e))}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
