"""gpu-smoke: the checks a CUDA machine owes the trainer, in one go (``python -m trainer gpu-smoke``).

The default run's steady step time and throughput, then verify-resume with deterministic algorithms;
the figures are printed and written to ``RUN_DIR/summary.json``.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path

import torch

from trainer.config import TrainConfig
from trainer.metrics import read_metrics
from trainer.model import ModelConfig
from trainer.train import train

from .verify import VERIFY_DEFAULTS, VERIFY_KILL_AT, verify_resume

__all__ = ["gpu_smoke"]


def gpu_smoke(steps: int, run_dir: str) -> bool:
    """Time ``steps`` steps of the default run, then verify-resume deterministically, on CUDA.

    Returns:
        True when verify-resume passed.

    Raises:
        ValueError: no CUDA device.
    """
    if not torch.cuda.is_available():
        raise ValueError("gpu-smoke needs a CUDA device; torch.cuda.is_available() is False here")
    base = Path(run_dir)
    shutil.rmtree(base / "default", ignore_errors=True)  # a fresh run each time, so the figures compare
    default_run = TrainConfig(
        run_dir=str(base / "default"), resume="never", max_steps=steps, device="cuda", progress=False
    )
    started = time.perf_counter()
    result = train(default_run)
    wall = time.perf_counter() - started
    step_times = [e["step_time"] for e in read_metrics(default_run.run_dir) if e["event"] == "step"]
    # The first steps include CUDA start-up and kernel selection; time the steady state.
    steady = statistics.median(step_times[len(step_times) // 4 :])
    tokens_per_step = default_run.batch_size * default_run.grad_accum * ModelConfig().block_size
    verify_config = TrainConfig(
        **{**VERIFY_DEFAULTS, "run_dir": str(base / "verify"), "device": "cuda", "deterministic": True}
    )
    verified = verify_resume(verify_config, VERIFY_KILL_AT)
    summary = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "default_run_steps": steps,
        "default_run_wall_s": round(wall, 1),
        "median_step_time_ms": round(steady * 1000, 2),
        "tokens_per_s": round(tokens_per_step / steady),
        "val_loss_first": result.val_losses[min(result.val_losses)],
        "val_loss_last": result.val_losses[max(result.val_losses)],
        "verify_resume_deterministic": "PASS" if verified else "FAIL",
    }
    print(json.dumps(summary, indent=2))
    (base / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    return verified
