"""Nothing a user owns is ever deleted (moe.outputs): `overwrite=true` replaces only what this product wrote,
and no command writes over, around or inside what it reads or a training run.

Each case puts real user files next to the paths, runs the command as a user would (the entry point, exit
status 2 and one paragraph) or through its function, and checks that every file is still there, byte for byte.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe.errors import UserError
from moe.outputs import MARKER, PREPARED_DATA, written_kind
from tests.conftest import REPO, run_entry

SAMPLE_TOK = str(REPO / "data" / "sample")
CORPUS = "\n".join(f"document {i}: the quick brown fox jumps over the lazy dog." for i in range(200)) + "\n"


def snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root (links included, by target) and its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def user_dir(tmp_path: Path) -> Path:
    """A directory of the user's: a corpus and an unrelated file."""
    d = tmp_path / "work"
    d.mkdir()
    (d / "corpus.txt").write_text(CORPUS)
    (d / "notes.md").write_text("my notes, not data\n")
    return d


def refused(proc, *words: str) -> str:
    """The entry point exited 2 with one paragraph naming `words`; returns that paragraph's first line."""
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = proc.stderr.strip()
    assert "Traceback" not in text, text
    for word in words:
        assert word in text, (word, text)
    return text.splitlines()[0]


def prep(**cfg) -> Path:
    from moe.data.prep_pipeline import prepare

    return prepare({"tokenizer": SAMPLE_TOK, "seq_len": 16, "val_fraction": 0.0, **cfg}, progress=False)


def test_data_prep_into_the_directory_holding_its_input_refuses_and_deletes_nothing(tmp_path):
    work = user_dir(tmp_path)
    before = snapshot(tmp_path)
    proc = run_entry("data_prep.py", f"input={work}/corpus.txt", "format=text", f"output={work}",
                     f"tokenizer={SAMPLE_TOK}", "seq_len=16", "overwrite=true", here=True)
    line = refused(proc, str(work), "holds input=", "corpus.txt")
    assert line.startswith("error: output=")
    assert snapshot(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["work"]


def test_data_prep_output_inside_its_input_directory_is_refused(tmp_path):
    work = user_dir(tmp_path)
    with pytest.raises(UserError, match="lies inside input="):
        prep(input=str(work), output=str(work / "prepared"))
    with pytest.raises(UserError, match="lies inside input="):  # a recursive glob reads its whole directory
        prep(input=str(work / "**" / "*.txt"), output=str(work / "prepared"))
    with pytest.raises(UserError, match=r"holds input \(.*corpus.txt\)="):  # a plain glob: its matches
        prep(input=str(work / "*.txt"), output=str(work))
    assert not (work / "prepared").exists()


def test_overwrite_replaces_prepared_data_it_wrote_but_never_a_users_directory(tmp_path):
    work = user_dir(tmp_path)
    out = prep(input=str(work / "corpus.txt"), output=str(tmp_path / "prepared"))
    assert written_kind(out) == PREPARED_DATA and (out / MARKER).is_file()
    (out / "stale.txt").write_text("from the first run")
    prep(input=str(work / "corpus.txt"), output=str(out), overwrite=True, seq_len=8)
    assert json.loads((out / "meta.json").read_text())["seq_len"] == 8 and not (out / "stale.txt").exists()

    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    before = snapshot(mine)
    with pytest.raises(UserError, match=f"without {MARKER}: overwrite=true replaces only a prepared data"):
        prep(input=str(work / "corpus.txt"), output=str(mine), overwrite=True)
    assert snapshot(mine) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "prepared", "work"]  # no temp dir left


def test_prepared_data_from_before_the_marker_is_still_recognised(tmp_path):
    work = user_dir(tmp_path)
    out = prep(input=str(work / "corpus.txt"), output=str(tmp_path / "old"))
    (out / MARKER).unlink()  # as an earlier version wrote it: meta.json only
    assert written_kind(out) == PREPARED_DATA
    prep(input=str(work / "corpus.txt"), output=str(out), overwrite=True)


def fake_run(tmp_path: Path) -> Path:
    """A training run's directory as train.py leaves it (the refusal comes before anything is loaded)."""
    run = tmp_path / "runs" / "exp1"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "step-000010.ckpt").write_bytes(b"weights")
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("seed: 1\n")
    for name, text in (("metrics.csv", "step,loss\n10,4.2\n"), ("train.log", "step 10/10\n")):
        (run / name).write_text(text)
    return run


@pytest.mark.parametrize("export", ["run", "run/hf", "run/checkpoints"])
def test_infer_export_into_the_run_it_reads_refuses_and_deletes_nothing(tmp_path, export):
    run = fake_run(tmp_path)
    target = {"run": run, "run/hf": run / "hf", "run/checkpoints": run / "checkpoints"}[export]
    before = snapshot(tmp_path)
    proc = run_entry("infer.py", f"ckpt={run}", f"export_hf={target}", "overwrite=true", here=True)
    refused(proc, "export_hf=", str(target))
    assert snapshot(tmp_path) == before and not (run / "hf").exists()


def test_consolidate_never_writes_over_its_source_or_a_users_file(tmp_path):
    import subprocess
    import sys

    from moe.checkpoint.sharded import DCP_METADATA, TRAINER_STATE

    run = fake_run(tmp_path)
    sharded = run / "checkpoints" / "step-000012.ckpt"  # a checkpoint directory: what consolidate reads
    sharded.mkdir()
    for name in (DCP_METADATA, TRAINER_STATE):
        (sharded / name).write_bytes(b"shards")
    before = snapshot(tmp_path)
    out = run / "checkpoints" / "last.ckpt"
    command = [sys.executable, "-m", "moe.tools.consolidate", str(run), str(out), "--overwrite"]
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    refused(proc, "OUT=", "lies inside SRC=")
    assert snapshot(tmp_path) == before
    mine = tmp_path / "model.ckpt"
    mine.write_text("my own file")
    from moe.tools.consolidate import convert

    for overwrite in (False, True):  # not a checkpoint torch wrote: --overwrite does not replace it
        with pytest.raises(UserError):
            convert(str(run), str(mine), overwrite=overwrite)
    assert mine.read_text() == "my own file"


def test_report_never_replaces_a_report_md_it_did_not_write(tmp_path):
    import subprocess
    import sys

    run = fake_run(tmp_path)
    (run / "report.md").write_text("# My notes on exp1\nthe lr was too high\n")
    before = snapshot(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "moe.report", str(run)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    refused(proc, "DIR=", "report.md this command did not write")
    assert snapshot(tmp_path) == before


def test_a_users_project_with_a_metrics_csv_is_not_taken_for_a_run(tmp_path):
    """A run is .hydra/ beside checkpoints/ or metrics.csv; a project directory holding its own metrics.csv
    or train.log still takes outputs below it."""
    project = user_dir(tmp_path)
    (project / "metrics.csv").write_text("my,own\n")
    (project / "train.log").write_text("my own log\n")
    out = prep(input=str(project / "corpus.txt"), output=str(project / "prepared"))
    assert written_kind(out) == PREPARED_DATA
    from moe.outputs import is_run_dir

    assert not is_run_dir(project) and is_run_dir(fake_run(tmp_path))


def test_a_directory_another_process_published_meanwhile_is_kept_whole(tmp_path):
    """Two runs building one data cache: the second to finish leaves the first's copy in place (an atomic
    rename the kernel refuses), never renames it aside while the first reads it."""
    from moe.errors import UserError
    from moe.outputs import publish

    out, first, second = tmp_path / "cache", tmp_path / ".first", tmp_path / ".second"
    for tmp, text in ((first, "first"), (second, "second")):
        tmp.mkdir()
        (tmp / "meta.json").write_text(text)
    publish(first, out, replace=False)
    with pytest.raises(UserError, match="was written by another process while this one worked"):
        publish(second, out, replace=False)
    assert (out / "meta.json").read_text() == "first" and (second / "meta.json").exists()
    publish(second, out, replace=True)  # overwrite asked: replaced whole
    assert (out / "meta.json").read_text() == "second"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache"]


def test_data_prep_output_that_is_its_tokenizer_dir_is_refused_and_deletes_nothing(tmp_path):
    """Already refused before these tests (the tokenizer is one of `reads`): kept so."""
    import shutil

    work = user_dir(tmp_path)
    tok = Path(shutil.copytree(SAMPLE_TOK, tmp_path / "tok"))
    before = snapshot(tmp_path)
    proc = run_entry("data_prep.py", f"input={work}/corpus.txt", f"output={tok}", f"tokenizer={tok}",
                     "seq_len=16", "overwrite=true", here=True)
    line = refused(proc, "is tokenizer=", str(tok))
    assert line.startswith(f"error: output='{tok}'")
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("export", ["hf", "hf/again"])
def test_infer_export_over_or_inside_the_hf_dir_it_reads_is_refused(tmp_path, export):
    """Already refused before these tests (hf_dir is one of `reads`): kept so."""
    from moe.infer.export import export_hf
    from tests.test_infer import tiny_model

    hf = export_hf(tiny_model(), tmp_path / "hf", SAMPLE_TOK)
    before = snapshot(tmp_path)
    proc = run_entry("infer.py", f"hf_dir={hf}", f"export_hf={tmp_path / export}", "overwrite=true",
                     here=True)
    refused(proc, "export_hf=", "hf_dir=")
    assert snapshot(tmp_path) == before
