"""The fault matrix: what goes wrong with run folders on real machines, and what CheckpointManager does.

Every fault is injected for real: bytes flipped or cut on disk, a manifest rewritten, a symlinked step
folder, a pickle payload, a disk that is full or read-only, a writer SIGKILLed while forked children
live on. The promise each test states:

- a damaged or odd checkpoint is *skipped with a warning naming it*, and the newest valid one is used;
  nothing raises but the documented errors (``ResumeError`` for a checkpoint asked for by name);
- nothing in a payload ever runs (``weights_only`` loading only);
- a failed write raises an ``OSError`` naming the checkpoint and the OS error and leaves the folder as it
  was (no step folder, no temp leftover, earlier checkpoints intact);
- ``keep_last=K`` keeps K *valid* checkpoints to fall back on;
- the run-folder lock dies with the process that took it, whatever children it forked.
"""

from __future__ import annotations

import builtins
import errno
import hashlib
import json
import os
import pickle
import resource
import signal
import subprocess
import sys
import tempfile
import textwrap
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resumable_data import CheckpointManager, ResumeError
from resumable_data.checkpoint import CheckpointLockedError
from resumable_data.testing import assert_same
from trainer.data import prepare_data

REPO = Path(__file__).resolve().parents[2]
SUBPROCESS_TIMEOUT = 120


def small_state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {
        "model": {"w": torch.randn(64, 8, generator=g)},
        "dataloader": {"version": 1, "epoch": 0, "position": step * 4, "world_size": 1},
        "train_state": {"step": step},
    }


def step_names(manager: CheckpointManager) -> list[str]:
    return [path.name for path in manager.checkpoints()]


def run_folder_entries(manager: CheckpointManager) -> list[str]:
    return sorted(path.name for path in manager.directory.iterdir())


@pytest.fixture
def run(tmp_path: Path):
    """A run folder holding valid checkpoints of steps 1 and 2 (keep_last=3: nothing pruned here)."""
    with CheckpointManager(tmp_path / "run", keep_last=3) as manager:
        manager.save(1, small_state(1), metric=2.0)
        manager.save(2, small_state(2), metric=1.0)
        yield manager


def write_manifest(folder: Path, content: bytes) -> None:
    (folder / "manifest.json").write_bytes(content)


def falls_back_to_step_1(manager: CheckpointManager, name: str = "step-00000002") -> None:
    """latest() warns about ``name`` and returns step 1, whose state then loads."""
    with pytest.warns(UserWarning, match=f"skipping checkpoint .*{name}"):
        assert manager.latest() == manager.directory / "step-00000001"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_same(manager.load(), small_state(1))


# -- damaged payloads ------------------------------------------------------------------------------


def flip_bit(data: bytes) -> bytes:
    b = bytearray(data)
    b[len(b) // 2] ^= 0x04
    return bytes(b)


def random_bytes(n: int) -> bytes:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(n), dtype=torch.uint8).numpy().tobytes()


DAMAGES: dict[str, Callable[[bytes], bytes]] = {
    "bit-flipped": flip_bit,
    "block-zeroed": lambda d: d[: len(d) // 2] + bytes(64) + d[len(d) // 2 + 64 :],
    "truncated": lambda d: d[: len(d) // 3],
    "zero-byte": lambda d: b"",
    "random-same-size": lambda d: random_bytes(len(d)),
    "random-other-size": lambda d: random_bytes(1000),
    "appended": lambda d: d + b"\0" * 10,
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_damaged_payload_is_skipped_and_the_previous_checkpoint_used(run: CheckpointManager, damage: str) -> None:
    payload = run.directory / "step-00000002" / "state.pt"
    payload.write_bytes(DAMAGES[damage](payload.read_bytes()))
    falls_back_to_step_1(run)
    with pytest.raises(ResumeError, match="step-00000002"):
        run.load("step-00000002")
    # best() skips it too, and the next save still works and prunes.
    with pytest.warns(UserWarning, match="step-00000002"):
        assert run.best() == run.directory / "step-00000001"
    run.save(3, small_state(3))
    assert run.latest() == run.directory / "step-00000003"


def test_missing_payload_is_skipped(run: CheckpointManager) -> None:
    (run.directory / "step-00000002" / "state.pt").unlink()
    falls_back_to_step_1(run)


# -- odd manifests ----------------------------------------------------------------------------------


def valid_manifest(folder: Path) -> dict[str, Any]:
    return json.loads((folder / "manifest.json").read_text())


ODD_MANIFESTS: dict[str, Callable[[dict[str, Any]], bytes]] = {
    "nested 100,000 levels": lambda m: b"[" * 100_000 + b"]" * 100_000,
    "a field nested 100,000 levels": lambda m: (
        json.dumps({**m, "metric": 0}).replace('"metric": 0', '"metric": ' + "[" * 100_000 + "]" * 100_000).encode()
    ),
    "metric is a string": lambda m: json.dumps({**m, "metric": "low"}).encode(),
    "metric is a bool": lambda m: json.dumps({**m, "metric": True}).encode(),
    "metric is a list": lambda m: json.dumps({**m, "metric": [0.1]}).encode(),
    "step is a string": lambda m: json.dumps({**m, "step": "2"}).encode(),
    "step is a float": lambda m: json.dumps({**m, "step": 2.0}).encode(),
    "step is a bool": lambda m: json.dumps({**m, "step": True}).encode(),
    "size is a string": lambda m: json.dumps({**m, "size": str(m["size"])}).encode(),
    "size is NaN": lambda m: json.dumps({**m, "size": float("nan")}).encode(),
    "size is huge": lambda m: json.dumps({**m, "size": 10**400}).encode(),
    "sha256 is a number": lambda m: json.dumps({**m, "sha256": 12345}).encode(),
    "sha256 is not hex": lambda m: json.dumps({**m, "sha256": "z" * 64}).encode(),
    "created is beyond year 9999": lambda m: json.dumps({**m, "created": 1e308}).encode(),
    "version is a string": lambda m: json.dumps({**m, "version": "1"}).encode(),
    "version is unknown": lambda m: json.dumps({**m, "version": 99}).encode(),
    "payload names another file": lambda m: json.dumps({**m, "payload": "../../etc/passwd"}).encode(),
    "no step": lambda m: json.dumps({k: v for k, v in m.items() if k != "step"}).encode(),
    "a list": lambda m: b"[1, 2, 3]",
    "null": lambda m: b"null",
    "empty": lambda m: b"",
    "not UTF-8": lambda m: b"\xff\xfe{\x00",
    "huge (20 MB)": lambda m: json.dumps({**m, "library_version": "x" * 20_000_000}).encode(),
    "a 10,000-digit integer": lambda m: (
        json.dumps({**m, "size": 0}).replace('"size": 0', '"size": ' + "9" * 10_000).encode()
    ),
}


@pytest.mark.parametrize("odd", ODD_MANIFESTS)
def test_odd_manifest_is_skipped_with_a_warning(run: CheckpointManager, odd: str) -> None:
    folder = run.directory / "step-00000002"
    write_manifest(folder, ODD_MANIFESTS[odd](valid_manifest(folder)))
    falls_back_to_step_1(run)
    assert step_names(run) == ["step-00000001"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert run.best() == run.directory / "step-00000001"
    with pytest.raises(ResumeError, match="step-00000002"):
        run.load(folder)
    # Saving (which prunes, comparing metrics) is not broken by it either.
    run.save(3, small_state(3), metric=0.5)
    assert run.latest() == run.directory / "step-00000003"


@pytest.mark.parametrize("kind", ["folder", "fifo", "device"])
def test_manifest_that_is_not_a_regular_file_is_skipped_without_blocking(run: CheckpointManager, kind: str) -> None:
    manifest = run.directory / "step-00000002" / "manifest.json"
    manifest.unlink()
    if kind == "folder":
        manifest.mkdir()
    elif kind == "fifo":
        os.mkfifo(manifest)  # opening it for reading would block until a writer comes
    else:
        manifest.symlink_to("/dev/zero")  # endless bytes
    falls_back_to_step_1(run)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=70),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3),
    max_leaves=8,
)
MANIFEST_FIELDS = [
    "version",
    "step",
    "created",
    "created_iso",
    "payload",
    "sha256",
    "size",
    "library_version",
    "metric",
]


@settings(max_examples=100, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    replaced=st.dictionaries(st.sampled_from(MANIFEST_FIELDS), JSON, max_size=3),
    dropped=st.sets(st.sampled_from(MANIFEST_FIELDS), max_size=2),
    extra=st.dictionaries(st.text(max_size=8), JSON, max_size=2),
)
def test_fuzzed_manifest_fields_are_either_valid_or_skipped_with_a_warning(
    replaced: dict[str, Any], dropped: set[str], extra: dict[str, Any]
) -> None:
    """Arbitrary JSON values in any field: the checkpoint is used only if the manifest still vouches for
    it; otherwise latest(), checkpoints(), best() and save() skip it with a warning and never raise."""
    with tempfile.TemporaryDirectory() as tmp, CheckpointManager(Path(tmp) / "run", keep_last=2) as manager:
        manager.save(1, small_state(1), metric=1.0)
        folder = manager.save(2, small_state(2), metric=2.0)
        original = valid_manifest(folder)
        manifest = {**extra, **{k: v for k, v in original.items() if k not in dropped}, **replaced}
        try:
            content = json.dumps(manifest).encode()
        except (ValueError, RecursionError):  # not representable as JSON: nothing to test
            return
        write_manifest(folder, content)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            latest = manager.latest()
            manager.checkpoints()
            manager.best()
            manager.save(3, small_state(3), metric=0.5)
            manager.best()
        if latest == folder:
            # Used only if the fields that vouch for the payload are intact.
            for key in ("version", "step", "sha256", "size"):
                assert manifest[key] == original[key] and type(manifest[key]) is type(original[key])
        else:
            assert latest == manager.directory / "step-00000001"
            assert any("step-00000002" in str(w.message) for w in caught)
        assert manager.latest() == manager.directory / "step-00000003"


# -- payloads that would run code -------------------------------------------------------------------


class Payload:
    """Unpickling this runs ``open(marker, "w")``: it creates a file, so a test can tell it ran."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (builtins.open, (str(self.marker), "w"))


def plant_payload(folder: Path, marker: Path, *, legacy: bool) -> None:
    """Replace the payload with a pickle bomb and forge the manifest to vouch for it."""
    payload = folder / "state.pt"
    if legacy:
        payload.write_bytes(pickle.dumps({"model": Payload(marker)}))
    else:
        torch.save({"model": Payload(marker)}, payload)
    manifest = valid_manifest(folder)
    manifest["sha256"] = hashlib.sha256(payload.read_bytes()).hexdigest()
    manifest["size"] = payload.stat().st_size
    write_manifest(folder, json.dumps(manifest).encode())
    assert not marker.exists()


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy-pickle"])
def test_pickle_payload_never_runs(run: CheckpointManager, tmp_path: Path, legacy: bool) -> None:
    marker = tmp_path / "payload-ran"
    folder = run.directory / "step-00000002"
    plant_payload(folder, marker, legacy=legacy)
    # The manifest vouches for the bytes, so the checkpoint is "valid"; loading still refuses it.
    for verify in (True, False):
        with pytest.raises(ResumeError, match=r"step-00000002.*weights_only"):
            run.load(folder, verify=verify)
    with pytest.raises(ResumeError, match="weights_only"):
        run.load()
    assert not marker.exists()


# -- keep_last counts valid checkpoints --------------------------------------------------------------


def test_keep_last_keeps_k_valid_checkpoints_to_fall_back_on(tmp_path: Path) -> None:
    """keep_last=2, steps 10 and 20 with 20 corrupt, resume from 10, save 11: 10 must stay."""
    with CheckpointManager(tmp_path / "run", keep_last=2) as manager:
        manager.save(10, small_state(10))
        corrupt = manager.save(20, small_state(20))
        (corrupt / "state.pt").write_bytes(flip_bit((corrupt / "state.pt").read_bytes()))
        with pytest.warns(UserWarning, match="step-00000020"):
            assert manager.latest() == manager.directory / "step-00000010"
        manager.save(11, small_state(11))
        assert (manager.directory / "step-00000010").is_dir()
        # If 11 now goes bad too, there is still a valid one.
        (manager.directory / "step-00000011" / "state.pt").write_bytes(b"")
        with pytest.warns(UserWarning):
            assert manager.latest() == manager.directory / "step-00000010"
        # Once two newer valid ones exist, the older ones go (the corrupt 20 was replaced by a real 20).
        for step in (12, 20):
            manager.save(step, small_state(step))
        assert step_names(manager) == ["step-00000012", "step-00000020"]


# -- symlinked step folders -------------------------------------------------------------------------


def test_pruned_symlinked_step_folder_is_unlinked_not_left_behind(tmp_path: Path) -> None:
    archive = tmp_path / "archive"
    with CheckpointManager(archive) as manager:
        manager.save(1, small_state(1))
    with CheckpointManager(tmp_path / "run", keep_last=2) as manager:
        (manager.directory / "step-00000001").symlink_to(archive / "step-00000001", target_is_directory=True)
        assert manager.latest() == manager.directory / "step-00000001"
        for step in (2, 3, 4):
            manager.save(step, small_state(step))
        assert run_folder_entries(manager) == [".lock", "step-00000003", "step-00000004"]
    # Pruning removed the link, never what it points to.
    assert sorted(p.name for p in (archive / "step-00000001").iterdir()) == ["manifest.json", "state.pt"]


def test_symlink_leftover_from_a_crash_is_removed_by_the_next_save(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.mkdir()
    (target / "keep.txt").write_text("not ours")
    with CheckpointManager(tmp_path / "run") as manager:
        (manager.directory / ".tmp-deleted-step-00000001-abc").symlink_to(target, target_is_directory=True)
        (manager.directory / ".tmp-step-00000002-def").symlink_to(tmp_path / "dangling")
        manager.save(3, small_state(3))
        assert run_folder_entries(manager) == [".lock", "step-00000003"]
    assert (target / "keep.txt").read_text() == "not ours"


# -- failed writes: disk full, read-only -------------------------------------------------------------


@pytest.fixture
def disk_full(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], None]:
    """Make files named ``name`` opened for writing land on /dev/full: real ENOSPC from the kernel."""

    def arm(name: str) -> None:
        real_open = builtins.open

        def full_open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            if isinstance(file, (str, os.PathLike)) and Path(file).name == name and "w" in mode:
                return real_open("/dev/full", mode, *args, **kwargs)
            return real_open(file, mode, *args, **kwargs)

        monkeypatch.setattr(builtins, "open", full_open)

    return arm


def assert_write_failed_cleanly(manager: CheckpointManager, error: OSError, code: int, before: list[str]) -> None:
    assert isinstance(error, OSError) and error.errno == code
    message = str(error)
    assert str(manager.directory / "step-00000003") in message and os.strerror(code) in message
    assert "enforce fail" not in message
    assert run_folder_entries(manager) == before  # no step folder, no temp leftover
    assert_same(manager.load(), small_state(2))


@pytest.mark.parametrize("failing_file", ["state.pt", "manifest.json"])
def test_disk_full_raises_an_os_error_naming_the_checkpoint_and_leaves_nothing(
    run: CheckpointManager, disk_full: Callable[[str], None], failing_file: str
) -> None:
    before = run_folder_entries(run)
    disk_full(failing_file)
    with pytest.raises(OSError) as info:
        run.save(3, small_state(3))
    assert_write_failed_cleanly(run, info.value, errno.ENOSPC, before)


@pytest.mark.parametrize("call", ["fsync", "rename"])
def test_failing_fsync_or_rename_raises_an_os_error_and_leaves_nothing(
    run: CheckpointManager, monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    before = run_folder_entries(run)
    real = getattr(os, call)

    def fail(*args: Any, **kwargs: Any) -> Any:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(os, call, fail)
    with pytest.raises(OSError) as info:
        run.save(3, small_state(3))
    monkeypatch.setattr(os, call, real)
    assert_write_failed_cleanly(run, info.value, errno.EIO, before)


def test_disk_full_in_an_async_save_surfaces_on_the_next_call(tmp_path: Path, disk_full: Callable[[str], None]) -> None:
    with CheckpointManager(tmp_path / "run", async_save=True) as manager:
        manager.save(2, small_state(2))
        manager.wait()
        before = run_folder_entries(manager)
        disk_full("state.pt")
        manager.save(3, small_state(3))
        with pytest.raises(OSError) as info:
            manager.wait()
        assert_write_failed_cleanly(manager, info.value, errno.ENOSPC, before)


def test_read_only_file_system_raises_an_os_error_and_changes_nothing(
    run: CheckpointManager, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A disk remounted read-only: every new entry in the run folder fails with EROFS, as the kernel
    says it (faked at os.mkdir, the first thing a save creates, because this test may run as root)."""
    before = run_folder_entries(run)
    real_mkdir = os.mkdir

    def read_only_mkdir(path: Any, *args: Any, **kwargs: Any) -> None:
        if Path(path).parent == run.directory:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        real_mkdir(path, *args, **kwargs)

    monkeypatch.setattr(os, "mkdir", read_only_mkdir)
    with pytest.raises(OSError) as info:
        run.save(3, small_state(3))
    assert_write_failed_cleanly(run, info.value, errno.EROFS, before)


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions; the EROFS test covers this case")
def test_read_only_run_folder_raises_an_os_error_and_changes_nothing(run: CheckpointManager) -> None:
    before = run_folder_entries(run)
    run.directory.chmod(0o555)
    try:
        with pytest.raises(OSError) as info:
            run.save(3, small_state(3))
    finally:
        run.directory.chmod(0o755)
    assert_write_failed_cleanly(run, info.value, errno.EACCES, before)


def test_trainer_exits_2_with_one_error_line_when_the_checkpoint_cannot_be_written(tmp_path: Path) -> None:
    """A real write failure (the kernel refuses to grow a file past RLIMIT_FSIZE: EFBIG), end to end."""
    corpus = tmp_path / "text.txt"
    corpus.write_bytes(Path(json.__file__).read_bytes()[:2000])
    argv = [
        sys.executable, "-m", "trainer", "train", "--run-dir", str(tmp_path / "run"), "--data", str(corpus),
        "--cache-dir", str(tmp_path / "cache"), "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--block-size", "16", "--batch-size", "4", "--max-steps", "4", "--checkpoint-every", "2",
        "--eval-every", "100", "--eval-batches", "1", "--no-progress",
    ]  # fmt: skip
    prepare_data(corpus, tmp_path / "cache")  # tokenized here, so the limit only bites on the checkpoint
    limit = 30_000

    def limit_file_size() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run(
        argv, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=SUBPROCESS_TIMEOUT, preexec_fn=limit_file_size, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, output
    assert "Traceback" not in output
    assert "step-00000002" in errors[0] and os.strerror(errno.EFBIG) in errors[0], errors[0]
    assert sorted(p.name for p in (tmp_path / "run" / "checkpoints").iterdir()) == [".lock"]


# -- the lock ----------------------------------------------------------------------------------------


def test_stale_lock_file_of_a_dead_process_does_not_block(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / ".lock").write_text(json.dumps({"pid": 2**22 + 12345, "host": "gone"}))
    with CheckpointManager(folder) as manager:
        manager.save(1, small_state(1))


FORKING_WRITER = """
    import multiprocessing, os, sys, time
    from resumable_data import CheckpointManager
    manager = CheckpointManager(sys.argv[1])
    # What DataLoader workers are: forked children that outlive their parent for a while.
    context = multiprocessing.get_context("fork")
    running = context.Queue()

    def work():
        running.put(os.getpid())  # past fork's hooks: the state every running worker is in
        time.sleep(60)

    children = [context.Process(target=work, daemon=True) for _ in range(2)]
    for child in children:
        child.start()
    for _ in children:
        running.get(timeout=60)
    print(" ".join(str(c.pid) for c in children), flush=True)
    time.sleep(60)
"""


def test_lock_dies_with_a_sigkilled_writer_even_while_its_forked_children_live(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    writer = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(FORKING_WRITER), str(folder)],
        env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    children: list[int] = []
    try:
        assert writer.stdout is not None
        children = [int(pid) for pid in writer.stdout.readline().split()]
        assert len(children) == 2
        with pytest.raises(CheckpointLockedError, match=f"pid {writer.pid}"):
            CheckpointManager(folder)
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=SUBPROCESS_TIMEOUT)
        assert all(_alive(pid) for pid in children)  # the children still run...
        with CheckpointManager(folder) as manager:  # ...and a relaunch at once gets the folder
            manager.save(1, small_state(1))
    finally:
        writer.kill()
        for pid in children:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_forked_child_cannot_release_or_keep_the_parents_lock(tmp_path: Path) -> None:
    """The child's copy of the manager holds nothing: closing it there leaves the parent's lock in place."""
    with CheckpointManager(tmp_path / "run") as manager:
        pid = os.fork()
        if pid == 0:  # the child
            code = 0
            try:
                manager.close()
            except BaseException:
                code = 1
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        with pytest.raises(CheckpointLockedError):
            CheckpointManager(tmp_path / "run")
