"""The README's plot: what the tuner kept against the window it had, eager (H200) and
compiled (H100).

Every point is a confirmed tuned plan from benchmarks/RESULTS.md (the run named beside
it): a 6-layer Llama-shaped HF model, random bf16, batch 1, its eager step captured in
a CUDA graph; the window a one-CTA spin planted in every layer (none: the model as
built).  The band is what loading gate_proj can save it at most in all six layers (its
cold 15.0 us against 11.5-12.3 us with 24 MiB loaded, run 22's trace), as a share of
the step with the window: the consumer's ceiling, beside which the tuner also keeps
small q -> k -> v forks.  The compiled points (runs 25, 34, an H100: no H200 run yet) are
the same model's forward compiled by Inductor, each one's ceiling (the dash) that run's
probe of gate_proj over its own, shorter step.

    python -m benchmarks.headline [--out docs/headline.png]
"""
import argparse

#: (label, window us, ratio, low, high, run): confirmed plans, RESULTS.md.
POINTS = [
    ("nothing planted", 0, 1.0079, 1.0060, 1.0099, "run 20"),
    ("12 us after o_proj", 12, 1.0233, 1.0221, 1.0246, "run 22"),
    ("40 us after o_proj", 40, 1.0209, 1.0195, 1.0224, "run 21"),
    ("40 us before the MLP", 40, 1.0180, 1.0141, 1.0219, "run 22"),
]
#: (label, window us, ratio, low, high, run, ceiling us, step us, label offset in points):
#: compiled, RESULTS.md.
COMPILED = [
    ("compiled, 40 us before the MLP\n(12 us of it: the empty branch forks' own)", 40,
     1.0453, 1.0436, 1.0470, "run 34, H100", 31.09, 1027.8, (10, 2)),
    ("compiled, 12 us before the MLP\n(12.5 us of it: the empty forks' own)", 12,
     1.0393, 1.0381, 1.0406, "run 25, H100", 28.00, 893.2, (10, -8)),
]
#: What a load saved gate_proj, us per layer (run 22, the trace): 2.9-3.6; the band divides
#: it by the steps of run 22's rows (1092.4 us without a window, 1332.5 with 40 us).
SAVED_PER_LAYER = (2.9, 3.6)
LAYERS = 6


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.headline")
    parser.add_argument("--out", default="docs/headline.png")
    args = parser.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for label, window, ratio, low, high, run in POINTS:
        gain = (ratio - 1) * 100
        ax.errorbar(window + (1.2 if "before" in label else 0), gain,
                    yerr=[[gain - (low - 1) * 100], [(high - 1) * 100 - gain]],
                    fmt="o", capsize=3, color="tab:green" if window else "tab:gray")
        ax.annotate(f"{label}\n{ratio:.4f}x ({run})", (window, gain),
                    textcoords="offset points", xytext=(10, -18 if "before" in label else 2),
                    fontsize=7)
    for k, (label, window, ratio, low, high, run, ceiling, step, at) in enumerate(COMPILED):
        gain = (ratio - 1) * 100
        ax.errorbar(window - 1.2, gain,
                    yerr=[[gain - (low - 1) * 100], [(high - 1) * 100 - gain]],
                    fmt="s", capsize=3, color="tab:red")
        ax.plot([window - 4.5, window + 2], [ceiling / step * 100] * 2, color="tab:red", lw=1,
                ls="--", label=None if k else "the compiled step's window ceiling (gate_proj)")
        ax.annotate(f"{label}\n{ratio:.4f}x ({run})", (window, gain),
                    textcoords="offset points", xytext=at, fontsize=7)
    xs = [0, 45]
    lo = [SAVED_PER_LAYER[0] * LAYERS / 1332.5 * 100] * 2
    hi = [SAVED_PER_LAYER[1] * LAYERS / 1092.4 * 100] * 2
    ax.fill_between(xs, lo, hi, color="tab:blue", alpha=0.15,
                    label="gate_proj hot in all 6 layers (the eager step's ceiling, run 22)")
    ax.axhline(0, color="black", lw=0.6)
    ax.set_xlim(-2, 72)
    ax.set_ylim(-0.3, 5.6)
    ax.set_xlabel("idle window planted in every layer (us)")
    ax.set_ylabel("tuned gain, % of the step")
    ax.set_title("Llama-shaped, 6 layers, batch 1: what tune kept (eager: H200, "
                 "compiled: H100)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
