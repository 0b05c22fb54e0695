"""The install line the README gives works as written, and installs the library alone.

``pip install .`` from the checkout's root, into a fresh virtual environment, must give an
importable ``resumable_data`` and nothing else at the top level: a top-level ``trainer`` (or
``tests``, ``benchmarks``) would collide with users' own modules, and the trainer's harnesses patch
``torch.save`` and ``os.fsync`` process-wide.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import resumable_data

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "resumable_data"
# What a checkout holds that is not source: environments, build outputs, caches, run folders.
_NOT_SOURCES = (
    ".git",
    ".venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    ".*_cache",
    ".hypothesis",
    "runs",
    ".cache",
)


def _site_packages(prefix: Path) -> Path:
    return Path(sysconfig.get_path("purelib", vars={"base": str(prefix), "platbase": str(prefix)}))


def test_pip_install_of_the_checkout_gives_the_library_and_no_top_level_trainer(tmp_path: Path) -> None:
    fresh = tmp_path / "venv"
    venv.create(fresh, with_pip=False)
    python = fresh / "bin" / "python"
    # The README's `pip install .`, run from the checkout's root: pip builds a wheel of the checkout
    # and installs it. Here the two halves run apart — the build in the test venv (its setuptools, no
    # index), the install into the fresh interpreter — and dependencies (torch, numpy, torchdata) come
    # from the test venv below, so the test needs no index and stays quick.
    # The build runs in a copy of the checkout without its build outputs: setuptools reuses a
    # build/ folder it finds, which would hide what the current pyproject.toml packages.
    checkout = tmp_path / "checkout"
    shutil.copytree(REPO, checkout, ignore=shutil.ignore_patterns(*_NOT_SOURCES))
    wheels = tmp_path / "wheels"
    pip = [sys.executable, "-m", "pip"]
    quiet = {"cwd": checkout, "check": True, "capture_output": True, "text": True, "timeout": 300}
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(wheels), "."], **quiet
    )
    (wheel,) = wheels.glob("resumable_data-*.whl")
    subprocess.run([*pip, "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)], **quiet)
    site = _site_packages(fresh)
    top_level = sorted(
        p.name for p in site.iterdir() if not p.name.endswith((".dist-info", ".pth")) and p.name != "__pycache__"
    )
    assert top_level == [PACKAGE], f"the wheel installs {top_level}; only {PACKAGE!r} belongs at the top level"
    (dist_info,) = site.glob("resumable_data-*.dist-info")
    assert (dist_info / "top_level.txt").read_text().split() == [PACKAGE]
    assert (site / PACKAGE / "py.typed").is_file()

    # Import it from a folder outside the checkout: resumable_data must come from the fresh venv,
    # trainer must not be importable, and the subpackages must have been packaged.
    (site / "deps.pth").write_text(str(_site_packages(Path(sys.prefix))) + "\n")  # after the venv's own
    probe = (
        "import importlib.util, json, resumable_data, resumable_data.checkpoint, resumable_data.core, "
        "resumable_data.distributed, resumable_data.map, resumable_data.rng, resumable_data.streams; "
        "print(json.dumps({'file': resumable_data.__file__, 'trainer': importlib.util.find_spec('trainer') is not None, "
        "'names': resumable_data.__all__}))"
    )
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    result = subprocess.run(
        [str(python), "-c", probe], cwd=tmp_path, env=env, check=True, capture_output=True, text=True, timeout=120
    )
    found = json.loads(result.stdout)
    assert Path(found["file"]).is_relative_to(site), found
    assert found["trainer"] is False
    assert found["names"] == resumable_data.__all__
