"""Summary rows out: JSON, a markdown table, and PNG plots (matplotlib, optional: skipped with a
message where it is not installed)."""

import json
from collections import defaultdict
from pathlib import Path

from . import choose
from .metrics import Row

COLUMNS = (
    "dataset | T | batch | method | runtime | problems | tok/s | vs ar | vs llama-server | tau | accuracy | "
    "recovery [95% CI] | "
    "identical to ar | flips -/+ | first divergence (median; < 8 tokens) | "
    "first loose accept (exact position: median; < 8 tokens)"
)


def _num(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table_line(r: Row) -> str:
    recovery = "-"
    if r.recovery is not None:
        recovery = f"{r.recovery:.3f} [{_num(r.recovery_lo, '.3f')}, {_num(r.recovery_hi, '.3f')}]"
    identical = "-" if r.compared is None else f"{r.identical}/{r.compared}"
    flips = "-" if r.pass_to_fail is None else f"{r.pass_to_fail}/{r.fail_to_pass}"
    parted = None if r.compared is None else r.compared - r.identical
    divergence = "-" if not parted else f"{r.divergence_median:.0f}; {r.diverged_early}/{parted}"
    loose = "-"
    if r.with_loose:  # "~": some positions are only the start of their round (older results)
        loose = f"{'' if r.first_loose_exact else '~'}{r.first_loose_median:.0f}; {r.loose_early}/{r.with_loose}"
    speedup = "-" if r.speedup is None else f"{r.speedup:.2f}x"
    vs_peer = "-" if r.vs_peer is None else f"{r.vs_peer:.2f}x"
    cells = [
        r.dataset,
        f"{r.temperature:g}",
        str(r.batch),
        r.method,
        r.runtime or "-",
        str(r.problems),
        f"{r.tok_s:.2f}",
        speedup,
        vs_peer,
        _num(r.tau, ".2f"),
        f"{r.accuracy:.3f}",
        recovery,
        identical,
        flips,
        divergence,
        loose,
    ]
    return "| " + " | ".join(cells) + " |"


def markdown(rows: list[Row], notes: list[str], choices: list[choose.Choice] = ()) -> str:
    head = "| " + COLUMNS + " |"
    sep = "|" + "---|" * len(COLUMNS.split(" | "))
    lines = [head, sep, *(table_line(r) for r in rows)]
    flipped = [f"- {r.dataset} T={r.temperature:g} b={r.batch} {r.method}: {_flips(r)}" for r in rows if r.flipped]
    parts = ["\n".join(lines)]
    if flipped:
        parts.append("Flipped problems vs ar (problem#sample direction @first divergence):\n" + "\n".join(flipped))
    if choices:
        parts.append(choose.markdown(choices).rstrip("\n"))
    if notes:
        parts.append("Notes:\n" + "\n".join(f"- {n}" for n in notes))
    return "\n\n".join(parts) + "\n"


def _flips(r: Row) -> str:
    return ", ".join(f"{p}#{s} {d} @{'-' if pos is None else pos}" for p, s, d, pos in r.flipped)


def write(
    rows: list[Row], out_dir: Path, config: dict, notes: list[str], choices: list[choose.Choice] = ()
) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    summary = out_dir / "summary.json"
    body = {"config": config, "notes": notes, "rows": [r.as_dict() for r in rows]}
    if choices:
        body["choices"] = [c.as_dict() for c in choices]
    summary.write_text(json.dumps(body, indent=1, default=str))
    table = out_dir / "summary.md"
    table.write_text(markdown(rows, notes, choices))
    return [summary, table, *plots(rows, out_dir)]


# ---- plots
def plots(rows: list[Row], out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("[bench] matplotlib is not installed: no plots (pip install -e '.[bench]')")
        return []
    written = []
    for metric, ylabel, name in (
        ("speedup", "tokens/s over ar (same run)", "speedup"),
        ("vs_peer", "tokens/s over llama-server (same run)", "vs_llama_server"),
        ("recovery", "accuracy / accuracy of ar", "recovery"),
    ):
        written.append(_bars(plt, rows, metric, ylabel, out_dir / f"{name}.png"))
    written.append(_bars(plt, rows, "tau", "tokens per round", out_dir / "tau.png"))
    return [p for p in written if p]


def _bars(plt, rows: list[Row], metric: str, ylabel: str, path: Path) -> Path | None:
    """Grouped bars: one group per dataset / T / batch, one bar per method; the recovery bars
    carry their bootstrap interval."""
    groups = defaultdict(dict)
    for r in rows:
        if getattr(r, metric) is not None:
            groups[f"{r.dataset}\nT={r.temperature:g} b={r.batch}"][r.method] = r
    if not groups:
        return None
    methods = sorted({m for g in groups.values() for m in g})
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups) * max(1, len(methods) / 4)), 4))
    for i, method in enumerate(methods):
        xs, ys, err = [], [], [[], []]
        for x, g in enumerate(groups.values()):
            if method in g:
                value = getattr(g[method], metric)
                xs.append(x + (i - (len(methods) - 1) / 2) * width)
                ys.append(value)
                lo = g[method].recovery_lo if metric == "recovery" else None
                hi = g[method].recovery_hi if metric == "recovery" else None
                err[0].append(value - lo if lo is not None else 0)
                err[1].append(hi - value if hi is not None else 0)
        ax.bar(xs, ys, width, label=method, yerr=err if metric == "recovery" else None, capsize=2)
    ax.set_xticks(range(len(groups)), list(groups))
    ax.set_ylabel(ylabel)
    if metric in ("speedup", "vs_peer", "recovery"):
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_results(out: str | Path, result: dict, summary: str) -> None:
    """A one-off measurement's files: results.json (every figure) and summary.md (its tables),
    under `out`; the summary is printed too."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "summary.md").write_text(summary)
    print(summary)
