"""Every example in examples/ runs in its smoke mode and shows stop -> resume -> "identical: True".

Each example runs as a user would run it, in its own process (``python examples/NAME.py --smoke``),
with a timeout; its exit status and its closing line are the specification. Examples that need an
optional extra are skipped visibly where it is missing.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TESTS = Path(__file__).resolve().parent

# example -> (modules it needs, the extra that installs them)
EXAMPLES = {
    "train_loop.py": ((), None),
    "token_streaming.py": ((), None),
    "llm_pretraining.py": ((), None),
    "hf_parquet.py": (("datasets", "pyarrow"), "hf"),
    "torchvision_augment.py": (("torchvision",), "vision"),
}

# torchvision_compat makes PyPI's CUDA torchvision importable on torch's CPU wheel (see that module);
# the example itself is run unchanged.
_WITH_TORCHVISION_COMPAT = (
    "import runpy, sys; sys.path.insert(0, {tests!r}); "
    "from torchvision_compat import load_torchvision; load_torchvision(); "
    "sys.argv = [{path!r}, '--smoke']; runpy.run_path({path!r}, run_name='__main__')"
)


def test_every_example_is_listed() -> None:
    assert sorted(p.name for p in (ROOT / "examples").glob("*.py")) == sorted(EXAMPLES)


def example_command(name: str) -> list[str]:
    """The command that runs example ``name`` in its smoke mode; skips the test when its extra is missing."""
    modules, extra = EXAMPLES[name]
    for module in modules:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{name} needs the [{extra}] extra ({module} is not installed)")
    path = str(ROOT / "examples" / name)
    if "torchvision" in modules:
        return [sys.executable, "-c", _WITH_TORCHVISION_COMPAT.format(tests=str(TESTS), path=path)]
    return [sys.executable, path, "--smoke"]


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_resumes_identically(name: str) -> None:
    command = example_command(name)
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=240)
    output = result.stdout + result.stderr
    assert result.returncode == 0, f"{name} exited with {result.returncode}:\n{output[-3000:]}"
    assert result.stdout.strip().splitlines()[-1] == "identical: True", output[-3000:]
