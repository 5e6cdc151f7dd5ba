"""Every write the product makes, refused by the kernel as on a full disk (a file-size limit: EFBIG):
one paragraph naming the path, the errno and the fix, exit 2 at the entry point, and nothing half-written
under the file's name. The checkpoint's own case is in tests/test_bad_inputs.py (a whole run); the
single-file, sharded and DeepSpeed-partition saves share moe.checkpoint.io.atomic_torch_save."""
from __future__ import annotations

import logging

import pytest
from conftest import REPO, file_size_limit
from test_bad_inputs import exit_of, run_train

from moe.errors import UserError, stop_when_a_log_file_cannot_be_written, write_errno, write_failed
from moe.outputs import atomic_path

REFUSED = "could not be written (File too large: EFBIG)"


def test_a_run_whose_log_or_metrics_fill_the_disk_stops_with_one_paragraph(tmp_path):
    """train.py end to end: train.log and metrics.csv grow each step; whichever is refused first stops the
    run (exit 2, the file named), with no traceback and no summary.json claiming a finished run."""
    run_dir = tmp_path / "run"
    with file_size_limit(25_000):  # above the run's copy of tokenizer.json (21.6 kB)
        code, err = run_train(run_dir, "trainer.max_steps=300", "model.num_layers=1",
                              "trainer.checkpoint_every_n_steps=1000", "trainer.log_every_n_steps=1")
    assert code == 2 and "Traceback" not in err and "Logging error" not in err, err
    line = next(line for line in err.splitlines() if line.startswith("error: "))
    assert line.startswith(f"error: file='{run_dir}/") and REFUSED in line and "Fix: free space" in line, err
    assert line.split("'")[1].rsplit("/", 1)[1] in ("train.log", "metrics.csv")
    assert not (run_dir / "summary.json").exists()


def test_metrics_csv_keeps_whole_rows_when_a_row_is_refused(tmp_path):
    from moe.train.metrics import METRIC_COLUMNS, RunMetrics, read_metrics

    metrics = RunMetrics.__new__(RunMetrics)
    metrics.metrics_path = tmp_path / "metrics.csv"
    metrics._rewrite([{"step": s, "loss": 1.0} for s in (1, 2)])
    before = metrics.metrics_path.read_bytes()
    row = {name: "x" * 40 for name in METRIC_COLUMNS} | {"step": 3}
    with file_size_limit(len(before) + 50), pytest.raises(UserError) as err:
        metrics._append(row)  # half the row fits: the file is cut back
    assert str(err.value).startswith(f"file='{metrics.metrics_path}' {REFUSED}; cut back to the rows "
                                     "before step 3. Fix: free space")
    assert metrics.metrics_path.read_bytes() == before
    assert [r["step"] for r in read_metrics(metrics.metrics_path)] == ["1", "2"]
    with file_size_limit(10), pytest.raises(UserError, match="the file is as it was"):
        metrics._rewrite([{"step": 1, "loss": 2.0}])  # a resume's rewrite: the old file stays
    assert metrics.metrics_path.read_bytes() == before and len(list(tmp_path.iterdir())) == 1


def test_summary_json_is_whole_or_as_it_was(tmp_path):
    from moe.checkpoint.io import write_json_atomic

    path = tmp_path / "summary.json"
    write_json_atomic(path, {"steps": 1})
    with file_size_limit(100), pytest.raises(UserError) as err:
        write_json_atomic(path, {"steps": 2, "notes": "n" * 400})
    assert str(err.value).startswith(f"file='{path}' {REFUSED}; its temporary file was removed. Fix: ")
    assert path.read_text().startswith('{\n  "steps": 1')
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_train_log_stops_the_run_with_a_paragraph_not_a_logging_traceback_per_line(tmp_path, capsys):
    log = tmp_path / "train.log"
    handler = logging.FileHandler(log)
    logger = logging.getLogger()
    logger.addHandler(handler)
    try:
        stop_when_a_log_file_cannot_be_written()
        with file_size_limit(200), pytest.raises(UserError) as err:
            logging.getLogger("moe.test").warning("w" * 300)
    finally:
        logger.removeHandler(handler)
        handler.close()
    assert str(err.value).startswith(f"file='{log}' {REFUSED}. Fix: free space or fix permissions under "
                                     f"{tmp_path}")
    assert "Logging error" not in capsys.readouterr().err


@pytest.mark.parametrize("writer", ["report.md", "loss.png", "simulation.json", "infer output_file"])
def test_files_written_whole_through_atomic_path_leave_nothing_when_refused(tmp_path, writer):
    path = tmp_path / writer.replace(" ", "_")
    with file_size_limit(1000), pytest.raises(UserError) as err:
        with atomic_path(path) as tmp:
            tmp.write_bytes(b"z" * 5000)
    assert f"{REFUSED}; nothing was left under its name" in str(err.value)
    assert not list(tmp_path.iterdir())


def test_data_prep_on_a_full_disk_exits_2_and_leaves_no_output(tmp_path):
    from moe.data import prepare

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"the {i} quick brown fox jumps over the lazy dog {i}.\n" for i in range(300)))
    cfg = {"input": str(text), "seq_len": 32, "val_fraction": 0.1, "output": str(tmp_path / "out"),
           "tokenizer": str(REPO / "data" / "sample")}
    with file_size_limit(12_000):
        code, err = exit_of(prepare, cfg, False)
    assert code == 2 and "Traceback" not in err, err
    assert err.startswith(f"error: file='{tmp_path / 'out'}' {REFUSED}; its temporary directory was removed. "
                          "Fix: free space"), err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]  # no output, no temporary directory


def test_export_hf_on_a_full_disk_names_its_directory_and_leaves_nothing(tmp_path):
    from test_export import ours

    from moe.data.tokenizer import save_tokenizer, train_bpe
    from moe.infer.export import export_hf

    tok = train_bpe(["the cat sat on the mat"] * 20, 290, ["<|endoftext|>", "<|pad|>"], show_progress=False)
    save_tokenizer(tok, tmp_path / "tok", eos="<|endoftext|>", pad="<|pad|>")
    with file_size_limit(20_000), pytest.raises(UserError) as err:
        export_hf(ours(), tmp_path / "hf", str(tmp_path / "tok"))
    assert str(err.value).startswith(f"export_hf='{tmp_path / 'hf'}' {REFUSED}; its temporary directory was "
                                     "removed. Fix: free space")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tok"]


@pytest.mark.parametrize("text, errno_name", [
    ("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space\" })", "ENOSPC"),
    ("failed to write: File too large (os error 27)", "EFBIG"),
    ("IOError: Read-only file system", "EROFS"),  # pyarrow's text, no errno
])
def test_a_refusal_wrapped_by_a_library_is_still_named(text, errno_name):
    import errno

    assert write_errno(RuntimeError(text)) == getattr(errno, errno_name)
    assert f": {errno_name})" in str(write_failed("/x/y", RuntimeError(text)))
    assert write_errno(RuntimeError("unexpected pos 123")) is None
