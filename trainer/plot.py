"""plot: loss and learning rate over steps from a run's metrics log, with its resume points marked."""

from __future__ import annotations

from pathlib import Path

from .metrics import read_metrics

__all__ = ["plot_run"]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Write a PNG of train/val loss and learning rate over steps.

    Steps that ran twice (before a kill and again after the resume) are drawn once, from the
    latest attempt; each resume is a dashed vertical line.

    Args:
        run_dir: a run folder holding ``metrics.jsonl``.
        out: the PNG to write; ``RUN_DIR/metrics.png`` by default.

    Returns:
        The path written.

    Raises:
        FileNotFoundError: the folder has no metrics log.
        ValueError: the log has no training steps yet.
    """
    # Imported here so training never pays for matplotlib, and Agg needs no display.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events = read_metrics(run_dir)
    train = {e["step"]: (e["loss"], e["lr"]) for e in events if e["event"] == "step"}
    val = {e["step"]: e["val_loss"] for e in events if e["event"] == "eval"}
    resumes = sorted({e["step"] for e in events if e["event"] == "resume"})
    if not train:
        raise ValueError(f"{run_dir} has no training steps in its metrics log yet")
    steps = sorted(train)

    fig, (loss_ax, lr_ax) = plt.subplots(2, 1, sharex=True, figsize=(9, 6), height_ratios=(3, 1))
    loss_ax.plot(steps, [train[s][0] for s in steps], lw=0.8, alpha=0.7, label="train loss")
    loss_ax.plot(sorted(val), [val[s] for s in sorted(val)], "o-", label="val loss")
    loss_ax.set_ylabel("loss (nats/byte)")
    lr_ax.plot(steps, [train[s][1] for s in steps], color="tab:green")
    lr_ax.set_ylabel("learning rate")
    lr_ax.set_xlabel("optimizer step")
    for i, step in enumerate(resumes):
        for ax in (loss_ax, lr_ax):
            ax.axvline(step, color="tab:red", ls="--", lw=1, label="resumed" if ax is loss_ax and i == 0 else None)
    loss_ax.legend()
    loss_ax.set_title(f"{Path(run_dir).name}: {len(steps)} steps, {len(resumes)} resume(s)")
    fig.tight_layout()
    path = Path(out) if out is not None else Path(run_dir) / "metrics.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
