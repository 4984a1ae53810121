"""`prl status RUN`: what SLURM says of the run's jobs, and what the run directory says of its progress."""

from __future__ import annotations

import json

from prl import protocol, runstate, slurm
from prl.rundir import RunDir, complete_steps

SPARKS = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    return "".join(SPARKS[int((v - lo) / span * (len(SPARKS) - 1))] for v in values)


def read_metrics(rd: RunDir) -> list[dict]:
    """Per-step metrics trainer rank 0 appends to logs/attempt_N/trainer/metrics.jsonl, over every
    attempt (a step trained again after a resume: the newest attempt's record wins)."""
    by_step: dict[int, dict] = {}
    lines = [line for n in rd.attempts() for line in _lines(rd.logs / f"attempt_{n}/trainer/metrics.jsonl")]
    for line in lines:
        try:
            rec = json.loads(line)
            by_step[int(rec["step"])] = rec
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill
    return [by_step[k] for k in sorted(by_step)]


def _lines(path) -> list[str]:
    return path.read_text().splitlines() if path.is_file() else []


def status_lines(rd: RunDir) -> list[str]:
    lines = [f"run:         {rd.path}"] + _job_lines(rd)
    attempt = rd.attempt_dir()
    if attempt is not None:
        lines.append(f"attempt:     {attempt.name}")
        failed = attempt / protocol.FAILED
        if failed.is_file():
            lines.append(f"failed:      {failed.read_text().strip()}")
        lines += attempt_history(rd)
    weights, ckpts = complete_steps(rd.weights), complete_steps(rd.checkpoints)
    lines.append(f"last step:   {weights[-1] if weights else 0} (policy version with complete weights)")
    lines.append(f"checkpoint:  {'step_%d' % ckpts[-1] if ckpts else 'none'}")
    rewards = [m["rollout/reward_mean"] for m in read_metrics(rd) if "rollout/reward_mean" in m]
    if rewards:
        lines.append(f"reward:      {sparkline(rewards[-40:])}  first {rewards[0]:.3f} last {rewards[-1]:.3f}")
    return lines


def _first_line(path) -> str:
    return path.read_text().strip().splitlines()[0] if path.is_file() and path.read_text().strip() else ""


def attempt_history(rd: RunDir) -> list[str]:
    """One line per attempt: when and where it started, the checkpoints it completed, why it ended."""
    starts = {e.get("attempt"): e for e in rd.start_records()}
    lines = ["attempts:"]
    for n in rd.attempts():
        d = rd.logs / f"attempt_{n}"
        start = starts.get(n, {})
        where = f"job {start['job_id']}" if start.get("job_id") else "local"
        if start.get("restart"):
            where += f" restart {start['restart']}"
        done = (d / protocol.CHECKPOINTS_DONE).read_text().split() if (d / protocol.CHECKPOINTS_DONE).is_file() else []
        why = _first_line(d / protocol.ENDED) or ("running" if n == rd.attempts()[-1] else "ended without a word (killed?)")
        lines.append(f"  {n}: {start.get('time', '?')} {where} on {start.get('node', '?')}; "
                     f"checkpoints: {', '.join(done) or 'none'}; {why}")
    return lines


def _describe(st: slurm.JobState | None) -> str:
    if st is None:
        return "unknown to SLURM (not queued, no accounting record)"
    desc = f"{st.state} {st.elapsed} {st.nodes}".rstrip()
    if st.state == "PENDING":
        desc = f"PENDING ({st.reason or 'no reason given'}), expected start {st.start or 'unknown'}"
    return desc + (f" exit={st.exit_code}" if st.exit_code else "")


def _job_lines(rd: RunDir) -> list[str]:
    """The run's SLURM jobs (also requeued and hand-submitted ones) or its local launch."""
    if (local := runstate.live_local(rd)) is not None:
        return [f"job:         running locally, pid {local['pid']} (attempt {local['attempt']})"]
    ids = rd.job_ids()
    try:
        states = slurm.job_states(ids, script=str(rd.job_script))
    except slurm.SlurmUnknown as e:
        if not ids:
            return ["job:         never submitted to SLURM"]
        return [f"job:         {ids[-1]} UNKNOWN: SLURM did not answer ({e})"]
    ids += [j for j in states if j not in ids]  # sbatch'ed by hand, not started yet
    if not ids:
        return ["job:         never submitted to SLURM"]
    live = [j for j in ids if j in states and states[j].state in slurm.ACTIVE]
    shown = live[-1] if live else ids[-1]
    earlier = [j for j in ids if j != shown]
    return [f"job:         {shown} {_describe(states.get(shown))}" + (f"  (others: {', '.join(earlier)})" if earlier else "")]


def print_status(rd: RunDir) -> None:
    print("\n".join(status_lines(rd)))
