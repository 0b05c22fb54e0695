"""``--data`` as a folder of JSONL or Parquet documents: streamed, packed, resumed exactly.

The stream's own promise is checked in process (the trainer's document loader restored from a
state_dict mid-epoch, at an epoch's end and in the next epoch, with 0 and 2 workers, equals an
uninterrupted one); then the trainer's: a run stopped and resumed equals one never stopped, the
resume audit sees a changed text field, and (slow) ``verify-resume`` with a SIGKILL passes.
"""

from __future__ import annotations

import hashlib
import io
import json
import random
import subprocess
import sys
from contextlib import closing
from itertools import islice
from pathlib import Path
from typing import Any

import pytest
import torch

from helpers.trainer_runs import TINY, final_checkpoint, tiny
from resumable_data import ResumeError
from resumable_data.testing import assert_same
from system.verify import child_env
from trainer.__main__ import main
from trainer.config import TrainConfig
from trainer.documents import EOS, StreamData, document_data, document_files
from trainer.metrics import read_metrics
from trainer.parallel import Parallel
from trainer.train import train

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16
# 3 training files of 6 documents: about 40 windows of 17 tokens, so an epoch is about 10 batches of 4.
DOCS_PER_FILE = 6
STEPS = 12  # runs of the TINY preset this long hold an epoch (about 10 steps)


def write_documents(folder: Path, files: int = 4, docs: int = DOCS_PER_FILE, *, parquet: bool = False) -> Path:
    """``files`` files of ``docs`` documents of random words each, with a "text" and a "title" field."""
    words = Path(random.__file__).read_text().split()
    rng = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(files):
        rows = [
            {"text": " ".join(rng.choices(words, k=rng.randint(1, 12))), "title": f"doc {k}.{i}"} for i in range(docs)
        ]
        if parquet:
            pq = pytest.importorskip("pyarrow.parquet")
            pa = pytest.importorskip("pyarrow")
            pq.write_table(pa.Table.from_pylist(rows), folder / f"part-{k}.parquet", row_group_size=5)
        else:
            (folder / f"part-{k}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return folder


@pytest.fixture(scope="module")
def documents(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_documents(tmp_path_factory.mktemp("documents"))


def stream_data(data: Path, **overrides: Any) -> StreamData:
    config = TrainConfig(data=str(data), **{**TINY, **overrides})
    files = document_files(config.data)
    assert files is not None
    return document_data(config, BLOCK, files, Parallel(torch.device("cpu")))


def take(data: StreamData, n: int) -> list[torch.Tensor]:
    with closing(data.batches()) as batches:
        return [torch.stack(pair) for pair in islice(batches, n)]


def roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint file does to a state: torch.save, then a weights_only load."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def epoch_length(data: Path) -> int:
    """Batches in the first epoch (a stream's length is known once it is read)."""
    loader = stream_data(data).loader
    return sum(1 for _ in loader)


# -- the stream ----------------------------------------------------------------------------------


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_document_stream_resumes_exactly_from_a_state_dict(documents: Path, num_workers: int) -> None:
    """Stopped mid-epoch, right before and at the epoch's end, and in the next epoch (with 2 workers:
    mid-epoch only, each restore starts them), a new loader restored from the state, after a
    weights_only round trip, yields exactly the uninterrupted rest."""
    length = epoch_length(documents)
    assert length > 4
    stops = [1, length // 2, length - 1, length, length + 2] if num_workers == 0 else [length // 2]
    total = length + 4
    reference = take(stream_data(documents, num_workers=num_workers), total)
    assert len(reference) == total
    for stop in stops:
        first = stream_data(documents, num_workers=num_workers)
        before = take(first, stop)
        resumed = stream_data(documents, num_workers=num_workers)
        resumed.loader.load_state_dict(roundtrip(first.loader.state_dict()))
        assert_same(reference, before + take(resumed, total - stop), f"stopped after {stop}")


def test_document_batches_are_shifted_windows_with_end_of_document_tokens(documents: Path) -> None:
    data = stream_data(documents)
    batches = take(data, 3)
    x, y = batches[0]
    assert x.shape == y.shape == (4, BLOCK) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(torch.cat(batches).max()) == EOS
    # The validation set: the first windows of the last file, the same every time.
    assert_same(data.val, stream_data(documents).val, "validation windows")
    assert len(data.val) == TINY["eval_batches"] * TINY["batch_size"]


def test_peeking_at_the_next_batches_does_not_move_the_stream(documents: Path) -> None:
    data = stream_data(documents)
    reference = take(stream_data(documents), 8)
    with closing(data.batches()) as batches:
        got = [torch.stack(next(batches)) for _ in range(3)]
        peeked = data.peek(2)
        got += [torch.stack(pair) for pair in islice(batches, 5)]
    assert peeked == [hashlib.sha256(b[0].numpy().tobytes()).hexdigest()[:16] for b in reference[3:5]]
    assert_same(reference, got, "batches")


def test_parquet_documents_stream_and_resume(tmp_path: Path) -> None:
    folder = write_documents(tmp_path / "parquet", parquet=True)
    reference = take(stream_data(folder), 10)
    first = stream_data(folder)
    before = take(first, 4)
    resumed = stream_data(folder)
    resumed.loader.load_state_dict(roundtrip(first.loader.state_dict()))
    assert_same(reference, before + take(resumed, 6), "batches")
    assert_same(reference, take(stream_data(write_documents(tmp_path / "jsonl")), 10), "the same documents as JSONL")


def test_document_folders_are_recognized_and_bad_ones_refused(tmp_path: Path, documents: Path) -> None:
    assert document_files(documents) == sorted(documents.glob("*.jsonl"))
    (tmp_path / "text.txt").write_text("plain text\n")
    assert document_files(tmp_path / "text.txt") is None and document_files(None) is None
    mixed = write_documents(tmp_path / "mixed", files=2)
    (mixed / "notes.txt").write_text("plain text\n")
    with pytest.raises(ValueError, match="mixes"):
        document_files(mixed)
    with pytest.raises(ValueError, match="2 or more files"):
        stream_data(write_documents(tmp_path / "one", files=1))
    with pytest.raises(ValueError, match="no text field 'body'"):
        stream_data(documents, text_field="body")


# -- the trainer ---------------------------------------------------------------------------------


def test_training_on_documents_stopped_and_resumed_equals_one_run(tmp_path: Path, documents: Path) -> None:
    """Across the epoch boundary, with the loader's state, the audit and the RNGs in the checkpoint;
    the model's vocabulary holds the end-of-document token."""
    assert epoch_length(documents) < STEPS
    reference = train(tiny(tmp_path, "reference", data=documents, max_steps=STEPS))
    first = train(tiny(tmp_path, "interrupted", data=documents, max_steps=STEPS, stop_at=5))
    second = train(tiny(tmp_path, "interrupted", data=documents, max_steps=STEPS))
    assert second.resumed_from is not None and first.step == 5
    assert_same(reference.losses, {**first.losses, **second.losses}, "losses")
    final = final_checkpoint(reference.run_dir)
    assert_same(final, final_checkpoint(second.run_dir), "final checkpoint")
    assert final["model_config"]["vocab_size"] == EOS + 1
    assert final["dataloader"]["epoch"] == 1  # the run crossed an epoch


def test_the_resume_audit_covers_the_document_stream(tmp_path: Path, documents: Path) -> None:
    """A changed --grad-accum reads other batches next: the stream restores, the audit refuses."""
    train(tiny(tmp_path, "run", data=documents, max_steps=STEPS, stop_at=4))
    with pytest.raises(ResumeError, match=r"resume audit failed.*the next batch"):
        train(tiny(tmp_path, "run", data=documents, max_steps=STEPS, grad_accum=2))
    with pytest.raises(ResumeError):  # another text field: the carried document is not the one saved
        train(tiny(tmp_path, "run", data=documents, max_steps=STEPS, text_field="title"))


@pytest.mark.slow  # three trainer processes, about 10 s each on 2 cores
@pytest.mark.parametrize("num_workers", [0, 2])
def test_verify_resume_passes_on_a_folder_of_documents(tmp_path: Path, documents: Path, num_workers: int) -> None:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "progress"]
    argv = ["verify-resume", "--data", str(documents), "--run-dir", str(tmp_path), *flags, "--max-steps=12"]
    assert main([*argv, "--kill-at-step", "7", "--num-workers", str(num_workers)]) == 0


@pytest.mark.slow  # five torchrun jobs of 2 (elastic: 1 and 3) ranks, about 2 minutes on 2 cores
def test_verify_resume_under_torchrun_passes_on_a_folder_of_documents(tmp_path: Path, documents: Path) -> None:
    """``verify-resume --nproc 2 --data <documents>``: each rank streams its share of the files; rank 0
    is SIGKILLed during step 7, and the resumed run's losses, final model and optimizer, and both
    ranks' weights equal the uninterrupted run's bitwise; the elastic resumes (2->1, 2->3) finish."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "progress"]
    command = [sys.executable, "-m", "trainer", "verify-resume", "--data", str(documents), "--run-dir", str(tmp_path)]
    done = subprocess.run(
        [*command, *flags, "--max-steps=12", "--kill-at-step=7", "--nproc=2"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=600,  # verify-resume waits 900 s for each job: a hung rank must not hang the suite
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS: the resumed run is identical to the uninterrupted one" in done.stdout, done.stdout
    assert "FAIL" not in done.stdout, done.stdout
    # The resumed run really resumed on 2 ranks, from a checkpoint before the kill.
    resumed = [e for e in read_metrics(tmp_path / "interrupted") if e["event"] == "resume"]
    assert resumed and 0 < resumed[-1]["step"] < 7
    ends = [e for e in read_metrics(tmp_path / "uninterrupted") if e["event"] == "end"]
    assert len(ends[-1]["rank_weights"]) == 2


@pytest.mark.slow  # a trainer process
def test_python_m_trainer_trains_on_a_folder_of_documents(tmp_path: Path, documents: Path) -> None:
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items() if k != "progress"]
    command = [sys.executable, "-m", "trainer", "--data", str(documents), "--run-dir", str(tmp_path / "run"), *flags]
    done = subprocess.run(
        [*command, "--max-steps=6", "--no-progress"],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "3 files of documents, streamed" in done.stdout and "done: 6 steps" in done.stdout
