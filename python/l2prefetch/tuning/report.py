"""The tuner's report: Markdown tables, and a PNG where matplotlib is installed.

Per batch: the verdict (the confirmed plan and its ratio, or why the plan
is empty), the confirmations, and one row per role: the most its loads
could gain (the cold-to-hot gap), the window from the fork to the consumer,
the measured times of the arms (:class:`~l2prefetch.tuning.arms.Arm`):
(a) no forks, (b) the loads, (d) the same forks empty, each a mean over
graph instances with its 95% interval, the instances of (b), and whether it
was kept or why not.
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from typing import Any, Optional

from .._files import write_atomic
from ..profile import EAGER_STEP, describe_step, step_compiled
from .stats import Interval

__all__ = ["markdown", "plot", "spread_text", "table"]


def _replays(result: Any) -> str:
    """Replays per instance: the setting's, or each batch's where they differ from it
    (a backend that chooses them by the step's time)."""
    fixed = result.settings.get("rounds")
    per_batch = [(rep.batch, rep.rounds) for rep in result.batches if rep.rounds is not None]
    if fixed and all(rounds == fixed for _, rounds in per_batch):
        return f"{fixed} replays each"
    how = "by the step's time" if not fixed else "as the backend prepared them"
    return f"replays each {how} (" + ", ".join(f"{rounds} at batch {batch}"
                                               for batch, rounds in per_batch) + ")"


def _bitwise(c: Any) -> str:
    """A confirmation's outputs against the step's without forks: the plan's, and its
    forks' with empty tables (EMPTY_FORKS_DIFFER where only those differ)."""
    if not c.identical:
        return "NO"
    return "yes" if c.empty_identical else "NO (the empty forks)"


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; numbers are right-aligned.  The one table helper of the
    package and the benchmarks."""
    def cell(x: Any) -> str:
        return str(x).replace("|", "\\|")

    def number(x: Any) -> bool:
        return isinstance(x, (int, float)) or _numeric(x)

    # a column of numbers stays right-aligned where a cell is blank (not measured)
    align = ["---:" if any(number(r[i]) for r in rows)
             and all(number(r[i]) or r[i] == "" for r in rows) else "---"
             for i in range(len(header))]
    lines = ["| " + " | ".join(cell(h) for h in header) + " |",
             "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _numeric(x: Any) -> bool:
    text = str(x).strip().lstrip("+-")
    return bool(text) and text.replace(".", "", 1).replace("x", "", 1).isdigit()


def _t(x: Optional[Interval]) -> str:
    return "" if x is None else f"{x.estimate:.1f} +- {x.half_width:.1f}"


def _opt(x: Optional[float], digits: int = 1) -> str:
    return "" if x is None or math.isnan(x) else f"{x:.{digits}f}"   # NaN: not measured


def markdown(result: Any) -> str:
    device = result.device or {}

    step = getattr(result, "step", None) or EAGER_STEP
    head = [f"# l2prefetch tune: {len(result.roles)} roles, batches "
            f"{[r.batch for r in result.batches]}", "",
            f"**Tuned on the {describe_step(step)} step.**  Its profile applies to "
            + ("compiled steps only: a controller made from it refuses forks that run "
               "eagerly." if step_compiled(step) else
               "eager steps only: a controller made from it refuses forks in code "
               "torch.compile made (tune with --compile for those).  Each fork's loads end "
               "by reading the tensor at its site (warm_activation), which the next kernel "
               "reads first."), ""]
    for name, why in sorted((result.settings or {}).get("not_offered", {}).items()):
        head.append(f"- {name}: {why}.")
    if (result.settings or {}).get("not_offered"):
        head.append("")
    if (result.settings or {}).get("within_compilation"):
        head += ["Outputs were compared within one compilation (each arm with its own graph "
                 "without forks): two compilations of this step in its mode can differ "
                 "bitwise (autotuning), so no profile can promise the logits of another "
                 "compilation, with or without it.", ""]
    if device:
        head.append(f"Device: {device.get('name')} (sm_{device.get('sm')}, "
                    f"{device.get('sm_count')} SMs, {device.get('l2_bytes', 0) / 2**20:.0f} MiB "
                    f"L2, driver {device.get('driver_version')}).  ")
    versions = result.versions or {}
    head.append("Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()) + ".  ")
    s = result.settings
    more = s.get("max_instances") or s.get("instances")
    head.append(f"Tuning took {result.elapsed_s:.0f} s of a {result.budget_s:.0f} s budget; "
                f"{s.get('instances')} graph instances per arm, " + _replays(result)
                + ", interleaved"
                + (f", up to {more} for a candidate whose interval was still undecided "
                   + (f" and up to {s['lead_max_instances']} for a group's lead whose paired "
                      "interval was wider than the resolution"
                      if s.get("lead_max_instances", more) != more else "")
                   + " (column 'instances')"
                   if more != s.get("instances") else "")
                + ".  A setting that names layers forks at those only, except in a "
                "'layer' trial (each layer's loads alone), whose forks ran at every layer and "
                "loaded at the one named.  "
                "Times are us per decode step: means of per-instance "
                "medians +- half their 95% interval; a role is kept when the 95% intervals of "
                "(a) - (b) and of (d) - (b) lie above zero, and the plan only when its "
                "confirmation on fresh instances is a gain.  The verdict's step us is the "
                "first capture replayed alone (the tuner's time estimate); the groups' (a) "
                "is the step without forks among interleaved instances.")
    out = ["\n".join(head), ""]
    out.append("## Verdict\n")
    rows = []
    for rep in result.batches:
        conf = rep.confirmed
        if conf is None:
            rows.append([rep.batch, _opt(rep.step_us), "empty", "", "", rep.reason])
        else:
            low, high = conf.ratio_interval
            rows.append([rep.batch, _opt(rep.step_us), len(rep.plan), f"{conf.ratio:.4f}",
                         f"{low:.4f}-{high:.4f}", rep.reason])
    out.append(table(["batch", "step us", "roles kept", "ratio (a / plan)", "95% interval",
                      "result"], rows))
    for rep in result.batches:
        out.append(f"## Batch {rep.batch}\n")
        if math.isnan(rep.step_us) and not rep.roles:   # not prepared: nothing to show
            out.append(f"{rep.reason[:1].upper()}{rep.reason[1:]}.\n")
            continue
        if rep.confirmations:
            rows = []
            for c in rep.confirmations:
                names = "; ".join(f"{n} [{st.label()}]" for n, st in c.roles)
                rows.append([names, _t(c.a), _t(c.plan), c.gain.format(2), f"{c.ratio:.4f}",
                             "" if c.loads is None else c.loads.format(2),
                             "" if c.forks is None else c.forks.format(2),
                             _bitwise(c)])
            out.append("Confirmations (fresh instances; beside (a) and the plan, the plan's "
                       "forks with empty tables: the loads' share is empty - plan, the forks' "
                       "own is a - empty):\n")
            out.append(table(["plan", "a us", "plan us", "a - plan us", "ratio",
                              "of which loads us", "of which forks us", "bitwise equal"],
                             rows))
        if rep.spread is not None:
            out.append(spread_text(rep.spread) + "\n")
        rows = []
        for role in rep.roles:
            best = role.chosen
            if best is None and role.trials:
                best = max(role.trials, key=lambda t: t.gain.estimate)
            rows.append([
                role.role, role.layers, f"{role.max_bytes / 2**20:.1f}", _opt(role.gap_us, 2),
                _opt(role.chain_gap_us, 2), _opt(role.window_us),
                "" if best is None else best.setting.label(),
                "" if best is None else _t(best.a), "" if best is None else _t(best.b),
                "" if best is None else _t(best.d),
                "" if best is None else best.gain.format(2),
                "" if best is None else best.instances,
                # a lead kept on its confirmation alone (no verify fit) says so
                "kept" if role.kept and (best is None or best.stage != "confirm")
                else role.reason])
        out.append("Roles (the best or verified setting of each):\n")
        out.append(table(["role", "layers", "max MiB", "gap us", "loads' gap us", "window us",
                          "setting",
                          "a us", "b us", "d us", "a - b us", "instances", "kept / why not"],
                         rows))
        if rep.not_refined:
            out.append(f"Not refined: {', '.join(rep.not_refined)}.  The budget left no room "
                       "to try their other grids and kernels, so their settings keep the "
                       "default grid and kernel; a larger budget_s (--budget), or fewer roles "
                       "(candidates=, --roles), tries them.\n")
    return "\n".join(out)


def spread_text(spread: Any) -> str:
    """The batch's instance spread and what best-of-k captures would save."""
    k = spread.recommended_k()
    saves = ", ".join(f"k={n}: {us:.1f} us ({100 * us / spread.mean_us:.2f}%)"
                      for n, us in spread.best_of.items())
    advice = ("keeping the fastest capture would save under 0.1% of the step: not worth it"
              if k == 1 else
              f"capture the step {k} times and keep the fastest "
              f"(l2prefetch.graphs.capture_fastest(step, k={k}); about "
              f"{(k - 1) * spread.capture_s:.1f} s more start-up per batch size)")
    return (f"Instance spread of the step without forks: {spread.instances} captures, SD "
            f"{spread.sd_us:.1f} us, {spread.low_us:.1f}-{spread.high_us:.1f} us "
            f"({spread.spread_pct:.2f}%).  Keeping the fastest of k captures is expected to save "
            f"{saves}; {advice}.")


def plot(result: Any, path: str) -> bool:
    """Each measured role's best gain against no forks with its interval, per batch."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    reps = [r for r in result.batches if any(role.trials for role in r.roles)]
    fig, axes = plt.subplots(1, max(1, len(reps)), figsize=(6 * max(1, len(reps)), 4.5),
                             squeeze=False)
    for ax, rep in zip(axes[0], reps):
        names, est, err, colors = [], [], [], []
        for role in rep.roles:
            trial = role.chosen or (max(role.trials, key=lambda t: t.gain.estimate)
                                    if role.trials else None)
            if trial is None:
                continue
            names.append(role.role)
            est.append(trial.gain.estimate)
            err.append(trial.gain.half_width)
            colors.append("tab:green" if role.kept else "tab:gray")
        ys = range(len(names))
        ax.barh(list(ys), est, xerr=err, color=colors)
        ax.set_yticks(list(ys))
        ax.set_yticklabels(names, fontsize=7)
        ax.axvline(0, color="black", linewidth=0.8)
        ax.set_xlabel("us saved per step against no forks (95% interval)")
        ax.set_title(f"batch {rep.batch}: step {rep.step_us:.0f} us")
        ax.invert_yaxis()
    if not reps:
        axes[0][0].text(0.5, 0.5, "nothing was measured", ha="center")
    fig.tight_layout()
    image = io.BytesIO()   # written by l2prefetch, not matplotlib: a regular file, atomically
    fig.savefig(image, format="png", dpi=110)
    plt.close(fig)
    write_atomic(path, image.getvalue(), "plot")
    return True
