"""`prl status RUN`: what SLURM says of the run's jobs, and what the run directory says of its progress.

    prl status RUN          # text for people
    prl status RUN --json   # the same facts for scripts (gather() is the one source of both)
"""

from __future__ import annotations

import json
import shlex

from prl.control import fork, runstate, slurm

from prl.control.progress import Progress, eval_records, read_metrics
from prl.run import launches, protocol
from prl.run.rundir import RunDir, complete_steps

SPARKS = "▁▂▃▄▅▆▇█"
__all__ = ["gather", "print_status", "read_metrics", "sparkline", "status_lines"]


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARKS[int((v - lo) / span * (len(SPARKS) - 1))] for v in values)


def gather(rd: RunDir) -> dict:
    """Every fact `prl status` shows, as plain data."""
    job = job_info(rd)
    attempt = launches.attempt_dir(rd)
    failed = attempt / protocol.FAILED if attempt is not None else None
    weights = complete_steps(rd.weights)
    records = read_metrics(rd)
    rewards = [m["rollout/reward_mean"] for m in records if "rollout/reward_mean" in m]
    # An SFT job has no reward: its loss is the curve to show.
    losses = [m["train/loss"] for m in records if "train/loss" in m] if not rewards else []
    return {
        "run": str(rd.path), "job": job,
        "live": job.get("state") in slurm.ACTIVE or job.get("local_pid") is not None,
        "attempt": attempt.name if attempt is not None else None,
        "failed": failed.read_text().strip() if failed is not None and failed.is_file() else None,
        "attempts": attempt_records(rd),
        "progress": Progress.of(rd).as_dict(),
        "policy_version": weights[-1] if weights else 0,
        "checkpoints": complete_steps(rd.checkpoints),
        "rewards": rewards,
        "losses": losses,
        # A mixture-of-experts policy's routing (prl.trainer.routing): the worst layer's expert load.
        "routing": [[m["routing/load_max_over_mean"], m["routing/entropy"]] for m in records
                    if "routing/load_max_over_mean" in m and "routing/entropy" in m],
        # On-policy distillation (a `teacher` section): the student's reverse KL to its teacher.
        "teacher_kl": [m["train/teacher_kl"] for m in records if "train/teacher_kl" in m],
        "evals": evals(rd),
        "truncation": truncation(records),
        "forked_from": fork.origin(rd),
        "wandb": wandb_info(rd),
    }


def truncation(records: list[dict]) -> dict | None:
    """The newest step's truncated share of rollouts per training environment (env/NAME/truncated_frac),
    and over-long rollouts masked out of its batch; None before the first step."""
    suffix = "/truncated_frac"
    last = next((m for m in reversed(records) if any(k.startswith("env/") and k.endswith(suffix) for k in m)), None)
    if last is None:
        return None
    names = sorted(k[len("env/"):-len(suffix)] for k in last if k.startswith("env/") and k.endswith(suffix))
    return {"step": last.get("step"), "environments": {n: last[f"env/{n}{suffix}"] for n in names},
            "masked": last.get("rollout/overlong_masked", 0.0)}


def job_info(rd: RunDir) -> dict:
    """The run's SLURM job (the live one, else the newest; requeued and hand-submitted ones count)
    or its local launch."""
    if (local := runstate.live_local(rd)) is not None:
        return {"state": "RUNNING", "local_pid": int(local["pid"]), "local_attempt": local.get("attempt")}
    ids = launches.job_ids(rd)
    try:
        states = slurm.job_states(ids, script=str(rd.job_script))
    except slurm.SlurmUnknown as e:
        return {"state": "UNKNOWN", "id": ids[-1], "error": str(e)} if ids else {"state": None}
    ids += [j for j in states if j not in ids]  # sbatch'ed by hand, not started yet
    if not ids:
        return {"state": None}
    live = [j for j in ids if j in states and states[j].state in slurm.ACTIVE]
    shown = live[-1] if live else ids[-1]
    info = {"id": shown, "others": [j for j in ids if j != shown]}
    st = states.get(shown)
    if st is None:
        return info | {"state": "GONE"}
    info |= {"state": st.state, "elapsed": st.elapsed, "nodes": _nodes(st), "exit_code": st.exit_code,
             "exit_meaning": _exit_meaning(st.exit_code)}
    return info | ({"reason": st.reason, "expected_start": st.start} if st.state == "PENDING" else {})


def _nodes(st: slurm.JobState) -> dict[str, str]:
    """Nodes per component: a het job's group g runs the component whose het_group is g (no group 2:
    the orchestrator shares the first trainer node); a plain job's nodes are shared by all."""
    if not any(nodes for _, nodes in st.het_nodes):  # a pending job has no nodes yet
        return {"all": st.nodes} if st.nodes else {}
    by_group = {c.het_group: c.name for c in protocol.COMPONENTS if c.name in protocol.RL_NAMES}  # not its envserver
    nodes = {by_group.get(g, f"group {g}"): nodes for g, nodes in st.het_nodes}
    orchestrator = protocol.BY_NAME["orchestrator"]
    if orchestrator.het_group not in dict(st.het_nodes):
        nodes[orchestrator.name] = "(the first trainer node)"
    return nodes


def _exit_meaning(exit_code: str) -> str | None:
    """sacct's "12:0" (status:signal) of the batch script (het leader) -> "trainer failed"."""
    try:
        status, _, sig = exit_code.partition(":")
        status, sig = int(status), int(sig or 0)
    except ValueError:
        return None
    if status:
        return protocol.EXIT_MEANINGS.get(status)
    return f"killed by signal {sig}" if sig else None


def attempt_records(rd: RunDir) -> list[dict]:
    """Per attempt: when and where it started, the checkpoints it completed, why it ended."""
    starts = {e.get("attempt"): e for e in launches.start_records(rd)}
    attempts = launches.attempts(rd)
    out = []
    for n in attempts:
        att, start = rd.attempt(n), starts.get(n, {})
        out.append({"attempt": n, "time": start.get("time"), "job_id": start.get("job_id"),
                    "restart": start.get("restart"), "node": start.get("node"),
                    "checkpoints": (att.read(protocol.CHECKPOINTS_DONE) or "").split(),
                    "ended": _first_line(att.marker(protocol.ENDED)) or None, "newest": n == attempts[-1]})
    return out


def _first_line(path) -> str:
    text = path.read_text().strip() if path.is_file() else ""
    return text.splitlines()[0] if text else ""


def evals(rd: RunDir) -> list[dict]:
    """RUN/evals/step_N.json, by step: whatever the evaluation wrote; `reward_mean` is what status shows."""
    return eval_records(rd)


def wandb_info(rd: RunDir) -> dict | None:
    """The W&B run id and, for offline runs with files, the command that uploads them."""
    id_file = rd.path / "wandb_id"
    if not id_file.is_file():
        return None
    info = {"id": id_file.read_text().strip(), "mode": _wandb_mode(rd)}
    offline = sorted((rd.path / "wandb").glob("offline-run-*"))
    if info["mode"] == "offline" and offline:
        # Every attempt leaves its own offline-run-* directory under the same id: sync them all.
        info["sync"] = f"wandb sync {shlex.quote(str(rd.path / 'wandb'))}/offline-run-*"
    return info


def _wandb_mode(rd: RunDir) -> str | None:
    import yaml

    try:
        return yaml.safe_load(rd.config.read_text())["run"]["wandb"]["mode"]
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return None


def status_lines(rd: RunDir) -> list[str]:
    return render(gather(rd))


def render(s: dict) -> list[str]:
    lines = [f"run:         {s['run']}"] + _job_lines(s["job"])
    if s.get("forked_from"):
        lines.append(f"forked from: {s['forked_from']['from']} at step {s['forked_from']['step']}")
    if s["attempt"] is not None:
        lines.append(f"attempt:     {s['attempt']}")
        if s["failed"]:
            lines.append(f"failed:      {s['failed']}")
        lines += ["attempts:"] + [_attempt_line(a) for a in s["attempts"]]
    lines.append(f"progress:    {Progress.from_dict(s['progress']).line(live=s['live'])}")
    lines.append(f"last step:   {s['policy_version']} (policy version with complete weights)")
    ckpts = s["checkpoints"]
    lines.append(f"checkpoints: {', '.join(f'step_{c}' for c in ckpts[-5:]) if ckpts else 'none'}"
                 + (f" ({len(ckpts)} complete)" if len(ckpts) > 5 else ""))
    if s["rewards"]:
        r = s["rewards"]
        lines.append(f"reward:      {sparkline(r[-40:])}  first {r[0]:.3f} last {r[-1]:.3f}")
    if s.get("losses"):
        r = s["losses"]
        lines.append(f"loss:        {sparkline(r[-40:])}  first {r[0]:.3f} last {r[-1]:.3f}")
    if s.get("teacher_kl"):
        r = s["teacher_kl"]
        lines.append(f"teacher KL:  {sparkline(r[-40:])}  first {r[0]:.3f} last {r[-1]:.3f}")
    if s.get("routing"):
        load = [r[0] for r in s["routing"]]
        lines.append(f"routing:     {sparkline(load[-40:])}  expert load max/mean (worst layer) last {load[-1]:.2f}, "
                     f"router entropy last {s['routing'][-1][1]:.3f}")
    if s.get("truncation"):
        t = s["truncation"]
        lines.append("truncated:   " + ", ".join(f"{n} {v:.0%}" for n, v in t["environments"].items())
                     + f" of step {t['step']}'s rollouts" + (f" ({t['masked']:.0f} masked)" if t["masked"] else ""))
    shown = [e for e in s["evals"] if isinstance(e.get("reward_mean"), (int, float))][-3:]
    if shown:
        lines.append("evals:       " + "; ".join(f"step {e['step']} reward {e['reward_mean']:.3f}" for e in shown))
    if s["wandb"]:
        w = s["wandb"]
        lines.append(f"wandb:       run id {w['id']} ({w['mode']})" + (f"; upload with: {w['sync']}" if "sync" in w else ""))
    return lines


def _attempt_line(a: dict) -> str:
    where = f"job {a['job_id']}" if a["job_id"] else "local"
    if a["restart"]:
        where += f" restart {a['restart']}"
    why = a["ended"] or ("running" if a["newest"] else "ended without a word (killed?)")
    return (f"  {a['attempt']}: {a['time'] or '?'} {where} on {a['node'] or '?'}; "
            f"checkpoints: {', '.join(a['checkpoints']) or 'none'}; {why}")


def _job_lines(job: dict) -> list[str]:
    state = job.get("state")
    if "local_pid" in job:
        return [f"job:         running locally, pid {job['local_pid']} (attempt {job['local_attempt']})"]
    if state is None:
        return ["job:         never submitted to SLURM"]
    if state == "UNKNOWN":
        return [f"job:         {job['id']} UNKNOWN: SLURM did not answer ({job['error']})"]
    others = f"  (others: {', '.join(job['others'])})" if job.get("others") else ""
    if state == "GONE":
        return [f"job:         {job['id']} unknown to SLURM (not queued, no accounting record){others}"]
    if state == "PENDING":
        desc = f"PENDING ({job['reason'] or 'no reason given'}), expected start {job['expected_start'] or 'unknown'}"
        if slurm.held(job["reason"]):
            desc += f": held, it starts only once released (scontrol release {job['id']})"
    else:
        desc = f"{state} {job['elapsed']}".rstrip()
    if job["exit_code"]:
        desc += f" exit={job['exit_code']}" + (f" ({job['exit_meaning']})" if job["exit_meaning"] else "")
    lines = [f"job:         {job['id']} {desc}{others}"]
    nodes = job["nodes"]
    if nodes:
        lines.append("nodes:       " + ("; ".join(f"{c} {n}" for c, n in nodes.items()) if "all" not in nodes else nodes["all"]))
    return lines


def print_status(rd: RunDir, as_json: bool = False) -> None:
    if as_json:
        print(json.dumps(gather(rd), indent=2))
    else:
        print("\n".join(status_lines(rd)))


def run_rows(parent) -> list[dict]:
    """`prl runs DIR`: every run directory directly under DIR, its state and progress. One squeue
    and one sacct for all of them (a hung slurmctld costs one timeout, not one per run)."""
    from pathlib import Path

    rds = sorted((RunDir(d) for d in Path(parent).iterdir() if d.is_dir() and RunDir(d).config.is_file()), key=lambda r: r.path.name)
    ids = [j for rd in rds for j in launches.job_ids(rd)]
    try:
        states, unknown = slurm.job_states(ids), None
    except slurm.SlurmUnknown as e:
        states, unknown = {}, str(e)
    rows = []
    for rd in rds:
        state = _run_state(rd, states, unknown)
        live = state.startswith(("RUNNING", "PENDING", "REQUEUED", "CONFIGURING", "COMPLETING"))
        rows.append({"run": rd.path.name, "path": str(rd.path), "state": state,
                     "progress": Progress.of(rd).as_dict(), "live": live})
    return rows


def _run_state(rd: RunDir, states: dict[str, slurm.JobState], unknown: str | None) -> str:
    if (local := runstate.live_local(rd)) is not None:
        return f"RUNNING (local, pid {local['pid']})"
    ids = launches.job_ids(rd)
    if ids and unknown is not None:
        return "UNKNOWN (SLURM did not answer)"
    live = [j for j in ids if j in states and states[j].state in slurm.ACTIVE]
    if live or (ids and ids[-1] in states):
        st = states[(live or ids)[-1]]
        meaning = _exit_meaning(st.exit_code)
        return f"{st.state} (job {st.job_id}{', ' + meaning if meaning else ''})"
    attempt = launches.attempt_dir(rd)
    ended = _first_line(attempt / protocol.ENDED) if attempt is not None else ""
    return ended or ("not started" if attempt is None else "stopped (no word why)")


def print_runs(parent, as_json: bool = False) -> None:
    rows = run_rows(parent)
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows:
        print(f"no prl run directories under {parent}")
        return
    width = max(len(r["run"]) for r in rows)
    for r in rows:
        p = Progress.from_dict(r["progress"])
        print(f"{r['run']:<{width}}  {r['state']:<34}  {p.line(live=r['live'])}")
