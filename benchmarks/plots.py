"""The report's PNG plots, drawn from the effect and layer sections' raw rows."""

from __future__ import annotations

import os


def plot(raws, outdir):
    """PNG plots of the effect and layer sections; returns (paths written, note).

    effect_<mib>mib.png: per batch 1 and 8, each variant's step time above hot
    (the physical limit) against the window T, so that the sub-us differences
    the table holds are visible.  layer_speedup.png: a / b per batch for the
    layer sections present (spin stand-ins, small kernels), against 1.0 and
    the 0.99x bound."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "No PNG plots: matplotlib is not installed."
    paths = []

    def save(fig, name):
        path = os.path.join(outdir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)

    effect = raws.get("effect") or []
    colors = {"cold": "tab:blue", "empty": "tab:gray", "prefetched": "tab:green"}
    for mib in sorted({row[0] for row in effect}):
        batches = [b for b in (1, 8) if any(m == mib and bb == b for m, bb, *_ in effect)]
        fig, axes = plt.subplots(1, len(batches), figsize=(4.5 * len(batches), 3.6),
                                 sharey=True, squeeze=False)
        for ax, batch in zip(axes[0], batches):
            pts = sorted((t, r) for m, b, t, r, _ in effect if m == mib and b == batch)
            for name, color in colors.items():
                ax.plot([t for t, _ in pts], [r[name] - r["hot"] for _, r in pts], color=color,
                        marker="o", label=name)
            ax.axhline(0.0, color="tab:red", linewidth=1.0, label="hot (the limit)")
            ax.set_xlabel("bandwidth-idle window T (us)")
            ax.set_title(f"batch {batch}")
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("step time above hot (us)")
        axes[0][0].legend(fontsize=7)
        fig.suptitle(f"GEMV over W = {mib} MiB after a spin of T us")
        save(fig, f"effect_{mib}mib.png")
    layers = [(label, raws[key]) for key, label in (("layer", "spin stand-ins"),
                                                    ("layer_glue", "small kernels"))
              if raws.get(key)]
    if layers:
        fig, ax = plt.subplots(figsize=(5.5, 3.6))
        batches = sorted({row["batch"] for _, rows in layers for row in rows})
        width = 0.8 / len(layers)
        ratios = []
        for k, ((label, rows), color) in enumerate(zip(layers, ("tab:green", "tab:orange"))):
            by = {row["batch"]: row["a"] / row["b"] for row in rows}
            xs = [n + (k - (len(layers) - 1) / 2) * width for n in range(len(batches))]
            # bars from 1.0: up is faster with the prefetch, down is slower
            ax.bar(xs, [by.get(b, float("nan")) - 1.0 for b in batches], width, bottom=1.0,
                   color=color, label=label)
            ratios += list(by.values())
        ax.set_xticks(range(len(batches)))
        ax.set_xticklabels([str(b) for b in batches])
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.axhline(0.99, color="tab:red", linewidth=0.8, linestyle="--", label="0.99x")
        ax.set_xlabel("batch")
        ax.set_ylabel("a / b (no prefetch / l2prefetch)")
        ax.set_title("Two Kimi-shaped MoE layers (TP8), candidate forks")
        ax.set_ylim(min(0.98, *ratios) - 0.005, max(1.02, *ratios) + 0.005)
        ax.legend(fontsize=7)
        save(fig, "layer_speedup.png")
    return paths, ""
