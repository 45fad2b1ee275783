"""The Echo Trap at a glance (paper section 4.1, Figure 4): one PNG of several runs' metrics.

    python tools/plot.py runs/a runs/b [--out echo.png] [--overwrite]

Reads each run folder's metrics.jsonl and config.json and draws the four signals the paper watches for the
collapse (average reward, in-group reward std, grad norm, entropy) and eval success with its 95% interval;
with `--collapse-every`, RAGEN-2's prompt-reasoning MI and prompt-retrieval accuracy (against chance). The
raw trace faint, a running mean of 5 bold, an x where the Echo Trap monitor fired on that signal; runs are
labelled by the settings that differ between them. RAGEN sends the same metrics to wandb.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import sys

# the repository root, for python tools/plot.py
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engine import cli  # noqa: E402

# (metric, panel title, the monitor's signal on it, the y axis)
PLOT_KEYS = [("rollout/reward_mean", "average reward", None, "reward per trajectory"),
             ("rollout/in_group_std", "in-group reward std", "std_collapse", "std of a group's rewards"),
             ("train/grad_norm", "grad norm", "grad_spike", "gradient norm (before clip)"),
             ("train/entropy", "entropy", "entropy_swing", "nats per sampled token"),
             ("eval/success", "eval success (95% CI; dashed: the start)", None, "success rate")]
# drawn when a run has it (template collapse)
MI_KEY = ("collapse/mi", "MI(prompt; reasoning)", "mi_collapse", "nats")
RETRIEVAL_KEY = ("collapse/retrieval_acc", "prompt retrieval (dashed: chance)", None, "accuracy")  # MI's twin
# never named in labels
PLOT_SAME = {"out", "resume", "overwrite", "plot", "plot_out", "groups", "groups_kept", "device", "threads"}


def read_runs(run_dirs: list[str]) -> dict[str, list[dict]]:
    """Each run folder's metrics lines; ValueError naming a folder or file that is not one."""
    runs = {}
    for run in run_dirs:
        path = Path(run) / "metrics.jsonl"
        if not path.is_file():
            raise ValueError(f"{run}: no metrics.jsonl in it (is it a run folder?)")
        try:
            runs[run] = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        except (ValueError, OSError) as e:
            raise ValueError(f"{run}: {path} is not a metrics file ({e})") from None
        if not runs[run]:
            raise ValueError(f"{run}: its metrics.jsonl holds no iteration yet (nothing to plot; the first "
                             f"iteration writes one line)")
    return runs


def run_labels(cfgs: dict) -> tuple[dict, list[str]]:
    """-> (each run's folder name with the settings that differ between the runs, those settings). A setting
    that a run's config lacks or leaves unset (None: an older run, or an opt-in left off) is not a difference:
    labels name only what two runs set differently (docs/main_command.png once suggested that its seeds ran
    different code)."""
    keys = sorted({k for c in cfgs.values() for k in c} - PLOT_SAME)
    differ = [k for k in keys if len({json.dumps(c[k]) for c in cfgs.values() if c.get(k) is not None}) > 1]
    names = {run: Path(run).name + (" (" + ", ".join(f"{k} {c.get(k)}" for k in differ) + ")" if differ
                                    else "") for run, c in cfgs.items()}
    return names, differ


def plot_runs(run_dirs: list[str], out_png: str | None, overwrite: bool = False) -> str:
    """The paper's four Echo Trap signals (section 4.1, Figure 4) and eval success of one or more runs, one
    PNG: the raw per-iteration trace faint, its running mean bold, eval points with their 95% intervals, the
    start's eval (iteration 0, train.py's --eval-start) as a dashed line, and a marker where the Echo Trap
    monitor fired on that signal. Runs are labelled by the settings that differ between them. An existing
    PNG is replaced only with `overwrite`."""
    runs = read_runs(run_dirs)
    out_png = out_png or str(Path(run_dirs[0]) / "echo_trap.png")
    if Path(out_png).exists() and not overwrite:
        raise ValueError(f"--out {out_png}: exists; nothing is replaced: choose another file, or --overwrite")
    out_png = str(cli.writable_file(out_png, "--out"))
    cfgs = {run: (cli.read_json(Path(run) / "config.json", run) if (Path(run) / "config.json").is_file()
                  else {})
            for run in runs}
    names, differ = run_labels(cfgs)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator
    measured = any(MI_KEY[0] in r for rows in runs.values() for r in rows)
    panels = PLOT_KEYS[:-1] + [MI_KEY, RETRIEVAL_KEY] * measured + PLOT_KEYS[-1:]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.6))
    for n, (run, rows) in enumerate(runs.items()):
        color, label = f"C{n % 10}", names[run]
        for ax, (key, title, signal, unit) in zip(axes, panels):
            have = [r for r in rows if r.get(key) is not None]
            ax.set_title(title, fontsize=10)
            ax.set_xlabel("iteration")
            ax.set_ylabel(unit, fontsize=9)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if not have:
                continue
            xs, ys = [r["step"] for r in have], [r[key] for r in have]
            if key == "eval/success":
                start = [r[key] for r in have if r["step"] == 0]
                if start:  # the starting policy's eval: what the run has to beat
                    ax.axhline(start[0], color=color, lw=1, ls="--")
                # max(0, .): Wilson's bound at 100% success can come out a rounding error below 1
                bars = [[max(0.0, r[key] - r["eval/success_lo"]) for r in have],
                        [max(0.0, r["eval/success_hi"] - r[key]) for r in have]]
                ax.errorbar(xs, ys, yerr=bars, color=color, marker="o", ms=4, capsize=4, lw=1.5, label=label)
                continue
            if key == RETRIEVAL_KEY[0]:  # measured every K iterations: points, and the chance level 1/N-ish
                ax.plot(xs, ys, color=color, lw=1.5, marker=".", label=label)
                ax.plot(xs, [r["collapse/retrieval_chance"] for r in have], color=color, lw=1, ls="--")
                continue
            ax.plot(xs, ys, color=color, lw=0.8, alpha=0.3, marker="." if key == MI_KEY[0] else None)
            # the running mean of 5
            trend = [statistics.fmean(ys[max(0, i - 4):i + 1]) for i in range(len(ys))]
            ax.plot(xs, trend, color=color, lw=2, label=label)
            fired = [(r["step"], r[key]) for r in have if signal and r.get(f"echo/{signal}")]
            if fired:
                ax.scatter(*zip(*fired), color=color, marker="x", s=40, zorder=3)
    last = max((r["step"] for rows in runs.values() for r in rows), default=1)
    for ax in axes:
        ax.set_xlim(0, last + 1)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8, frameon=False)
    what = ", ".join(differ) if differ else ", ".join(
        f"{k} {next(iter(cfgs.values())).get(k)}" for k in ("env", "algo", "filter")
        if cfgs and next(iter(cfgs.values())))
    fig.suptitle(f"Echo Trap signals{' by ' + what if differ else (' (' + what + ')' if what else '')}; "
                 f"bold: running mean of 5, x: monitor warning", fontsize=11)
    fig.tight_layout(rect=(0, 0.06 + 0.04 * ((len(labels) - 1) // 3), 1, 0.95))
    fig.savefig(out_png, dpi=110)
    plt.close(fig)
    return out_png


def main(argv=None):
    parser = cli.Parser(description=__doc__.split("\n")[0])
    parser.add_argument("runs", nargs="+", help="run folders (each holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="the PNG (default: FIRST_RUN/echo_trap.png)")
    parser.add_argument("--overwrite", action="store_true", help="replace the PNG if it exists")
    args = parser.parse_args(argv)
    try:
        print(plot_runs(args.runs, args.out, args.overwrite))
    except ValueError as e:
        cli.fail(str(e))


if __name__ == "__main__":
    cli.run(main)
