"""`prl plot RUN`: reward, loss, entropy and step time over steps, every attempt, in one PNG; with a
mixture-of-experts policy also its routing (the worst layer's expert load, max over mean, and the
router's entropy: prl.trainer.routing).

    prl plot RUN                 # writes RUN/metrics.png
    prl plot RUN -o curves.png

Reads logs/attempt_N/trainer/metrics.jsonl and RUN/evals/step_N.json only, so it works offline and
without W&B. Each attempt is drawn in its own colour: a resumed run's curve shows where it continued
(and a step trained twice shows both times). The reward panel adds the evals' mean reward (held-out
split) at the policy version each evaluated. matplotlib is imported here only (`pip install 'prl[plot]'`).
"""

from __future__ import annotations

from pathlib import Path

from prl.control.progress import eval_records, metrics_by_attempt
from prl.run.rundir import RunDir

PANELS = (("rollout/reward_mean", "reward"), ("train/loss", "loss"), ("train/entropy", "entropy"),
          ("perf/step_s", "seconds per step"))
"""(metrics.jsonl key, panel title), as prl.trainer.train reports them."""
ROUTING_PANELS = (("routing/load_max_over_mean", "expert load, max / mean (worst layer)"),
                  ("routing/entropy", "router entropy (mean over layers)"))
"""Added when the run's policy is a mixture of experts (its records carry them)."""
EVAL_COLOUR = "magenta"
"""Of the evals' curve: no attempt gets it (matplotlib's default cycle has none)."""


class PlotError(RuntimeError):
    """Nothing to plot, or matplotlib missing."""


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that carry `key` as a number."""
    pts = [(int(r["step"]), float(r[key])) for r in records if isinstance(r.get(key), (int, float))]
    return [s for s, _ in pts], [v for _, v in pts]


def plot_run(rd: RunDir, out: Path) -> Path:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on a login node
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotError("prl plot needs matplotlib: pip install 'prl[plot]' (or matplotlib)") from None
    by_attempt = {n: recs for n, recs in metrics_by_attempt(rd).items() if recs}
    if not by_attempt:
        raise PlotError(f"no step metrics yet under {rd.logs} (logs/attempt_N/trainer/metrics.jsonl)")
    routed = any(ROUTING_PANELS[0][0] in r for recs in by_attempt.values() for r in recs)
    panels = PANELS + (ROUTING_PANELS if routed else ())
    fig, axes = plt.subplots(len(panels) // 2, 2, figsize=(10, 3 * len(panels) // 2), sharex=True)
    for ax, (key, title) in zip(axes.flat, panels):
        for n, recs in by_attempt.items():
            steps, values = series(recs, key)
            if steps:
                ax.plot(steps, values, marker="." if len(steps) < 50 else None, label=f"attempt {n}")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    versions, rewards = series(eval_records(rd), "reward_mean")
    if versions:
        axes.flat[0].plot(versions, rewards, marker="o", color=EVAL_COLOUR, label="eval (held out), by policy version")
    for ax in axes[-1]:
        ax.set_xlabel("step")
    axes.flat[0].legend(fontsize="small")
    fig.suptitle(rd.path.name)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out
