"""PNG plots of the report: time vs W per implementation, bytes vs W, numerics error
vs offset. Needs matplotlib (the ``bench`` extra); drawn off-screen."""

from __future__ import annotations

from pathlib import Path
from typing import List

__all__ = ["write_all"]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def time_vs_world(report: dict, path: Path) -> bool:
    plt = _pyplot()
    summary = [s for s in report["timing"]["summary"] if s["world"] is not None]
    if not summary:
        return False
    from .plan import ORDER

    colors = {key: f"C{i}" for i, key in enumerate(ORDER)}
    fig, (ax_ms, ax_ratio) = plt.subplots(1, 2, figsize=(11, 5.6))
    bn_local = next((s for s in report["timing"]["summary"] if s["impl"] == "torch_bn" and s["world"] is None), None)
    for impl in dict.fromkeys(s["impl"] for s in summary):
        mine = sorted((s for s in summary if s["impl"] == impl), key=lambda s: s["world"])
        label = mine[0]["label"] + (" (per rank, W processes side by side)" if impl == "torch_bn" else "")
        worlds = [s["world"] for s in mine]
        ax_ms.plot(worlds, [s["geomean_ms"] for s in mine], marker="o", label=label, color=colors.get(impl))
        ratios = [s["median_ratio_to_bn"] for s in mine]
        if impl != "torch_bn" and all(r is not None for r in ratios):  # None: no torch peer ran
            ax_ratio.plot(worlds, ratios, marker="o", label=label, color=colors.get(impl))
    if bn_local:
        ax_ms.axhline(bn_local["geomean_ms"], color="k", ls=":", lw=1, label="torch.nn.BatchNorm2d, one process")
    ax_ratio.axhline(1.0, color="k", ls=":", lw=1)
    for ax in (ax_ms, ax_ratio):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("replicas W (per-replica batch fixed: global batch grows with W)")
        ax.grid(True, which="both", alpha=0.3)
    ax_ms.set_ylabel("ms, geometric mean over the grid")
    ax_ratio.set_ylabel("x BatchNorm2d on the same per-replica batch, median")
    ax_ms.set_title("forward + backward time", fontsize=10)
    ax_ratio.set_title("ratio to torch.nn.BatchNorm2d", fontsize=10)
    handles, labels = ax_ms.get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7, frameon=False)
    fig.suptitle("Per-layer training step vs replicas")
    fig.tight_layout(rect=(0, 0.14, 1, 1))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def bytes_vs_world(report: dict, path: Path) -> bool:
    plt = _pyplot()
    tables = report["communication"]["tables"]
    if not tables:
        return False
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for c, rows in tables.items():
        worlds = [r["world"] for r in rows]
        line = ax.plot(worlds, [r["syncbn_wire_bytes"] for r in rows], label=f"syncbn, C={c}")[0]
        counted = [r for r in rows if r["source"] == "counted"]
        if counted:
            ax.plot([r["world"] for r in counted], [r["syncbn_wire_bytes"] for r in counted], "o",
                    color=line.get_color(), label=f"syncbn, C={c}, counted in this run")
        ax.plot(worlds, [r["torch_syncbn_wire_bytes"] for r in rows], ls="--", color=line.get_color(),
                label=f"torch.nn.SyncBatchNorm algorithm, C={c}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("ranks W")
    ax.set_ylabel("bytes sent per rank per layer call (fwd + bwd)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    ax.set_title("Communication per BN layer call")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def numerics_vs_offset(report: dict, path: Path) -> bool:
    plt = _pyplot()
    rows = report["numerics"]["rows"]
    if not rows:
        return False
    offsets = report["numerics"]["offsets"]
    impls = list(dict.fromkeys(r["impl"] for r in rows))
    worlds = sorted({r["world"] for r in rows})
    styles = ["-", "--", ":", "-."]
    fig, ax = plt.subplots(figsize=(9, 4.6))
    for r in rows:  # one colour per implementation, one line style per W
        ys = [max(r["errors"].get(str(float(o)), float("nan")), 1e-12) for o in offsets]
        ax.plot(offsets, ys, marker="o", color=f"C{impls.index(r['impl']) % 10}",
                ls=styles[worlds.index(r["world"]) % len(styles)], label=f"{r['label']} (W={r['world']})")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("|mean| / std")
    ax.set_ylabel("relative error of the batch variance")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.01, 0.5))
    ax.set_title("Merged variance vs float64")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return True


def write_all(report: dict, out: Path) -> List[str]:
    names = []
    for name, draw in [("time_vs_world.png", time_vs_world), ("bytes_vs_world.png", bytes_vs_world),
                       ("numerics_vs_offset.png", numerics_vs_offset)]:
        if draw(report, Path(out) / name):
            names.append(name)
    return names
