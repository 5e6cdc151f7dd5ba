"""What comes from around a run: config files, files in other encodings, damaged indexes and caches, Ctrl-C,
an output that is one of the command's inputs. Each is one paragraph (or, for Ctrl-C, one line) and its exit
status, never a traceback or a hang, and leaves nothing half-written.

Each case was first met as a user meets it (a traceback, Hydra's exit 1, a file overwritten, data trained on
in the wrong encoding, a signal delivered twice) and is named by its test. `@case` records what the test
asserts: the command, the exit status and the first line of the paragraph (`{name}` stands for a path of the
test's, `(...)` for a library's words in brackets, a trailing `...` for the rest of the line). The table in
docs/FAULT_TOLERANCE.md ("Around a run") is generated from them (`python tests/test_around_the_run.py`; a test
without `@case` gets a row naming it), and a test fails when that copy is stale.

Commands run in the test process (conftest.run_entry(..., here=True)) unless a signal is the subject: Ctrl-C
is a real SIGINT sent to the process group of a real process, as a terminal sends it, at the moment the
command has its output written under a temporary name (moe.faults' MOE_TEST_PAUSE_BEFORE_RENAME).
"""
from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import FAST_RUN, REPO, compose_cfg, run_entry

SAMPLE_TOK = str(REPO / "data" / "sample")
DOC = REPO / "docs" / "FAULT_TOLERANCE.md"
BROKEN_YAML = "num_layers: 2\nhidden_size: [64\n"  # a flow sequence left open


def case(code: int, command: str, first: str):
    """What a test asserts, for the table: exit `code`, the `command` run and the `first` line said."""

    def mark(test):
        test.case = (code, command, first)
        return test

    return mark


def pattern(template: str, values: dict) -> str:
    """A case's first line as a regex: `{name}` is values[name] (`{name!r}` its repr as a string; any text
    when not given), `(...)` any text in brackets, `...` at the end any rest of the line."""
    rest = template.endswith("...")
    parts = re.split(r"\{(\w+)(!r)?\}", template.removesuffix("..."))
    rx = ""
    for i in range(0, len(parts), 3):
        rx += re.escape(parts[i]).replace(re.escape("(...)"), r"\(.*\)")
        if i + 1 < len(parts):
            name, as_repr = parts[i + 1], parts[i + 2]
            value = values.get(name)
            rx += ".*?" if value is None else re.escape(repr(str(value)) if as_repr else str(value))
    return rx + (".*" if rest else "")


def said(code: int, stderr: str, **values) -> str:
    """The calling test's case holds: exit status, no traceback, and its first line said once (a `Fix:` with
    it, for an error); returns that line."""
    want_code, _, first = globals()[sys._getframe(1).f_code.co_name].case
    assert code == want_code, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    lines = [line for line in stderr.splitlines() if re.fullmatch(pattern(first, values), line)]
    assert len(lines) == 1, (pattern(first, values), stderr[-3000:])
    if first.startswith("error: "):
        assert [line for line in stderr.splitlines() if line.startswith("error: ")] == lines, stderr[-3000:]
        assert "Fix: " in lines[0]
    return lines[0]


def snapshot(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def no_temporaries(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*") if ".tmp" in p.name or ".old-" in p.name]


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def ckpt_file(tmp_path_factory):
    """A tiny checkpoint as train.py writes one (its run's tokenizer: data/sample)."""
    from test_infer import save_ckpt, tiny_model

    return save_ckpt(tmp_path_factory.mktemp("ckpt") / "tiny.ckpt", tiny_model())


@pytest.fixture
def ckpt(ckpt_file, tmp_path):
    """A copy of the checkpoint for a test that may damage it."""
    copy = tmp_path / "model.ckpt"
    copy.write_bytes(ckpt_file.read_bytes())
    return copy


@pytest.fixture(scope="module")
def hf_export(tmp_path_factory):
    """A Mixtral directory as export_hf writes one."""
    from test_infer import tiny_model

    from moe.infer.export import export_hf

    return export_hf(tiny_model(), tmp_path_factory.mktemp("hf") / "tiny", SAMPLE_TOK)


@pytest.fixture
def hf_dir(hf_export, tmp_path):
    import shutil

    return Path(shutil.copytree(hf_export, tmp_path / "tiny"))


def fake_run(root: Path) -> Path:
    """A finished run's files as `python -m moe.report` reads them."""
    run = root / "runs" / "exp1"
    (run / ".hydra").mkdir(parents=True)
    (run / "metrics.csv").write_text("step,loss\n1,4.0\n2,3.5\n")
    (run / "summary.json").write_text(json.dumps({"steps": 2, "final_loss": 3.5}) + "\n")
    (run / ".hydra" / "config.yaml").write_text("seed: 1\nmodel:\n  top_k: 2\n")
    (run / ".hydra" / "overrides.yaml").write_text("- seed=1\n")
    return run


# -------------------------------------------------------------------------------------- config files
@case(2, "python train.py hydra.searchpath=[DIR] model=mine",
      "error: model='mine' cannot be read: {file} is not valid YAML at line 3, column 1 (while parsing a "
      "flow "
      "sequence at line 2, column 14: expected ',' or ']', but got '<stream end>'). Fix: correct the YAML in "
      "{file} at line 3, column 1 (or move the file aside)")
def test_a_yaml_syntax_error_in_a_config_group_file_names_the_file_line_and_column(tmp_path):
    """Hydra let yaml's ParserError through: a traceback from train.py's pre-flight."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    (tmp_path / "conf" / "model" / "mine.yaml").write_text(BROKEN_YAML)
    proc = run_entry("train.py", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "model=mine",
                     f"hydra.run.dir={tmp_path / 'run'}", here=True)
    said(proc.returncode, proc.stderr, file=tmp_path / "conf" / "model" / "mine.yaml")
    assert not (tmp_path / "run").exists()


@case(2, "python train.py hydra.searchpath=[DIR] model=wide",
      "error: model='wide' cannot be read: {file} is UTF-16LE, not UTF-8. Fix: convert it: iconv -f UTF-16 "
      "-t "
      "UTF-8 {file} > {file}.utf8 && mv {file}.utf8 {file}")
def test_a_config_file_in_utf16_names_its_encoding_and_how_to_convert_it(tmp_path):
    """Hydra's file source raised the decoder's UnicodeDecodeError, which names no file."""
    (tmp_path / "conf" / "model").mkdir(parents=True)
    wide = tmp_path / "conf" / "model" / "wide.yaml"
    wide.write_text((REPO / "conf" / "model" / "tiny.yaml").read_text(), encoding="utf-16")
    proc = run_entry("train.py", f"hydra.searchpath=[file://{tmp_path / 'conf'}]", "model=wide",
                     f"hydra.run.dir={tmp_path / 'run'}", here=True)
    said(proc.returncode, proc.stderr, file=wide)
    assert not (tmp_path / "run").exists()


@case(2, "python train.py -m +sweep=NAME (a sweeps/NAME.yaml with a YAML slip)",
      "error: sweep={name!r} cannot be read: {file} is not valid YAML at line 5, column 6 (while parsing a "
      "block mapping at line 3, column 5: expected <block end>, but found '<block mapping start>'). Fix: "
      "correct the YAML in {file} at line 5, column 6 (or move the file aside)")
def test_a_broken_sweep_file_stops_only_the_sweep_that_uses_it(tmp_path):
    """sweeps/*.yaml are registered when moe.config is imported: one broken file was a traceback for every
    train.py command. Now it is left out, other commands run, and `+sweep=` that file says why."""
    from moe.config.sweeps import UNREADABLE, register_sweeps

    name = f"broken_{os.getpid()}"
    sweep = tmp_path / f"{name}.yaml"
    sweep.write_text("hydra:\n  sweeper:\n    params:\n      seed: 1,2\n     trainer.max_steps: 1,2\n")
    try:
        assert register_sweeps(tmp_path) == []  # what `import moe.config` runs over sweeps/
        plan = run_entry("train.py", "dry_run=true", here=True)
        assert plan.returncode == 0, plan.stderr[-2000:]
        proc = run_entry("train.py", "-m", f"+sweep={name}", f"hydra.sweep.dir={tmp_path / 'multirun'}",
                         here=True)
    finally:
        UNREADABLE.pop(name, None)
    said(proc.returncode, proc.stderr, name=name, file=sweep)
    assert not (tmp_path / "multirun").exists()


@case(2, "python data_prep.py hydra.searchpath=[DIR] data=mine output=OUT",
      "error: data='mine' cannot be read: {file} is not valid YAML at line 3, column 1 (while parsing a flow "
      "sequence at line 2, column 10: expected ',' or ']', but got '<stream end>'). Fix: correct the YAML in "
      "{file} at line 3, column 1 (or move the file aside)")
def test_a_yaml_syntax_error_in_a_data_prep_preset_names_the_file_line_and_column(tmp_path):
    """data_prep.py (and infer.py) went straight to Hydra: a traceback, exit 1. They compose first now."""
    (tmp_path / "presets" / "data").mkdir(parents=True)
    preset = tmp_path / "presets" / "data" / "mine.yaml"
    preset.write_text("input: corpus.txt\nseq_len: [16\n")
    proc = run_entry("data_prep.py", f"hydra.searchpath=[file://{tmp_path / 'presets'}]", "data=mine",
                     f"output={tmp_path / 'out'}", here=True)
    said(proc.returncode, proc.stderr, file=preset)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["presets"]


@case(2, "python infer.py tempreature=0.5 prompt=hi",
      "error: tempreature='0.5' is refused when composing the config: Could not override 'tempreature': Key "
      "'tempreature' not in 'InferConfig'. Fix: check the spelling against docs/INFERENCE.md ...")
def test_an_infer_override_hydra_refuses_exits_2_not_1():
    """Hydra's own report of a composition error exits 1, which moe.supervise would retry."""
    proc = run_entry("infer.py", "tempreature=0.5", "prompt=hi", here=True)
    said(proc.returncode, proc.stderr)


# ---------------------------------------------------------------------------------- other encodings
@case(2, "python infer.py ckpt=CKPT prompts_file=PROMPTS (UTF-16)",
      "error: prompts_file={prompts!r} cannot be read: {prompts} is UTF-16LE, not UTF-8. Fix: convert it: "
      "iconv "
      "-f UTF-16 -t UTF-8 {prompts} > {prompts}.utf8 && mv {prompts}.utf8 {prompts}")
def test_infer_prompts_file_in_utf16_names_its_encoding(ckpt, tmp_path):
    """A prompts file saved by a Windows editor: UnicodeDecodeError, exit 1."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\nThe capital of France\n", encoding="utf-16")
    proc = run_entry("infer.py", f"ckpt={ckpt}", f"prompts_file={prompts}",
                     f"output_file={tmp_path / 'o.jsonl'}", here=True)
    said(proc.returncode, proc.stderr, prompts=prompts)
    assert not (tmp_path / "o.jsonl").exists() and "===" not in proc.stdout  # nothing generated


@case(2, "python infer.py ckpt=CKPT prompts_file=PROMPTS (Latin-1)",
      "error: prompts_file={prompts!r} cannot be read: {prompts} is not UTF-8 (byte 0xe9 on line 2, column "
      "4). "
      "Fix: save it as UTF-8 (from Latin-1, say: iconv -f LATIN1 -t UTF-8 {prompts} > {prompts}.utf8 && mv "
      "{prompts}.utf8 {prompts})")
def test_infer_prompts_file_in_latin1_names_the_byte_and_its_line(ckpt, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_bytes(b"Once upon a time\ncaf\xe9 au lait\n")
    proc = run_entry("infer.py", f"ckpt={ckpt}", f"prompts_file={prompts}", here=True)
    said(proc.returncode, proc.stderr, prompts=prompts)


@case(2, "python data_prep.py input=CORPUS (UTF-16) on_bad_row=skip output=OUT",
      "error: input={corpus!r} cannot be read: {corpus} is UTF-16LE, not UTF-8 (on_bad_row=skip or repair "
      "would "
      "keep every line but the first as text with NULs between the letters). Fix: convert it: iconv -f "
      "UTF-16 "
      "-t UTF-8 {corpus} > {corpus}.utf8 && mv {corpus}.utf8 {corpus}")
def test_data_prep_input_in_utf16_is_refused_even_with_on_bad_row_skip(tmp_path):
    """Only its first line (the byte-order mark) failed to decode: on_bad_row=skip then prepared every other
    line, a NUL between each two letters, and exited 0."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("".join(f"document {i}: the quick brown fox.\n" for i in range(200)), encoding="utf-16")
    proc = run_entry("data_prep.py", f"input={corpus}", f"output={tmp_path / 'out'}",
                     f"tokenizer={SAMPLE_TOK}", "seq_len=16", "on_bad_row=skip", here=True)
    said(proc.returncode, proc.stderr, corpus=corpus)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


@case(0, "python data_prep.py input=CORPUS (a .txt with a UTF-8 byte-order mark) output=OUT",
      "wrote {out}: ...")
def test_a_text_file_with_a_utf8_byte_order_mark_is_prepared_without_it(tmp_path):
    """The text builder read U+FEFF into the first row, which was tokenized and trained on."""
    from moe.data import load_prepared

    lines = "".join(f"document {i}: the quick brown fox.\n" for i in range(200))
    (tmp_path / "plain.txt").write_text(lines)
    (tmp_path / "marked.txt").write_text(lines, encoding="utf-8-sig")
    procs = {name: run_entry("data_prep.py", f"input={tmp_path / name}.txt", f"output={tmp_path / name}",
                             f"tokenizer={SAMPLE_TOK}", "seq_len=16", "val_fraction=0", here=True)
             for name in ("plain", "marked")}
    said(procs["marked"].returncode, procs["marked"].stdout, out=tmp_path / "marked")
    blocks = {name: load_prepared(tmp_path / name).splits["train"].get(range(3))[0].tolist()
              for name in procs}
    assert blocks["marked"] == blocks["plain"]


@case(2, "python data_prep.py input=CORPUS tokenizer=TOK (a damaged tokenizer_config.json) output=OUT",
      "error: tokenizer={tok!r} cannot be read: {tok}/tokenizer_config.json is not valid JSON at line 2, "
      "column "
      "1 (Expecting value). Fix: restore tokenizer_config.json, or delete it (the end-of-text token is then "
      "looked up in the vocabulary, or given as eos_token=TOKEN)")
def test_a_tokenizer_whose_tokenizer_config_json_is_damaged_is_named(tmp_path):
    """json.loads' JSONDecodeError reached Hydra: exit 1."""
    import shutil

    tok = Path(shutil.copytree(SAMPLE_TOK, tmp_path / "tok"))
    (tok / "tokenizer_config.json").write_text('{"eos_token": \n')
    (tmp_path / "corpus.txt").write_text("".join(f"document {i}: the quick brown fox.\n" for i in range(200)))
    proc = run_entry("data_prep.py", f"input={tmp_path / 'corpus.txt'}", f"output={tmp_path / 'out'}",
                     f"tokenizer={tok}", "seq_len=16", here=True)
    said(proc.returncode, proc.stderr, tok=tok)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt", "tok"]


# ----------------------------------------------------------------------------- damaged indexes, caches
@case(2, "python infer.py hf_dir=DIR (its model.safetensors.index.json cut short) prompt=hi",
      "error: hf_dir={hf!r} cannot be read: {hf}/model.safetensors.index.json is not valid JSON at line 2, "
      "column 1 (Expecting property name enclosed in double quotes). Fix: download the directory again; if "
      "its "
      "model.safetensors alone holds all the weights, delete model.safetensors.index.json instead")
def test_an_hf_dir_whose_safetensors_index_is_not_json(hf_dir):
    (hf_dir / "model.safetensors.index.json").write_text('{"weight_map": {\n')
    proc = run_entry("infer.py", f"hf_dir={hf_dir}", "prompt=hi", here=True)
    said(proc.returncode, proc.stderr, hf=hf_dir)


@case(2, "python infer.py hf_dir=DIR (an index without weight_map) prompt=hi",
      "error: hf_dir={hf!r} cannot be read: {hf}/model.safetensors.index.json holds no weight_map of tensor "
      "names "
      "to safetensors files. Fix: download the directory again; ...")
def test_an_hf_dir_whose_safetensors_index_has_no_weight_map(hf_dir):
    """KeyError: 'weight_map', exit 1 (model.init_from_hf=DIR reads the same index)."""
    (hf_dir / "model.safetensors.index.json").write_text('{"metadata": {"total_size": 1}}\n')
    proc = run_entry("infer.py", f"hf_dir={hf_dir}", "prompt=hi", here=True)
    said(proc.returncode, proc.stderr, hf=hf_dir)


@case(2, "python infer.py hf_dir=DIR (its generation_config.json cut short) prompt=hi",
      "error: hf_dir={hf!r} cannot be read: {hf}/generation_config.json is not valid JSON at line 2, column "
      "1 "
      "(Expecting value). Fix: restore generation_config.json, or delete it (the eos ids then come from "
      "config.json)")
def test_an_hf_dir_whose_generation_config_json_is_damaged(hf_dir):
    (hf_dir / "generation_config.json").write_text('{"eos_token_id": \n')
    proc = run_entry("infer.py", f"hf_dir={hf_dir}", "prompt=hi", here=True)
    said(proc.returncode, proc.stderr, hf=hf_dir)


@case(2, "python -m moe.report RUN (its summary.json cut short)",
      "error: DIR={run!r} cannot be read: {run}/summary.json is not valid JSON at line 1, column 13 "
      "(Expecting "
      "property name enclosed in double quotes). Fix: restore summary.json from a copy, or delete it: the "
      "report then uses what else the run dir holds")
def test_report_on_a_run_whose_summary_json_is_damaged(tmp_path):
    from moe.tools.report import main

    run = fake_run(tmp_path)
    (run / "summary.json").write_text('{"steps": 2,')
    code, err = exit_code_of(main, [str(run)])
    said(code, err, run=run)
    assert not (run / "report.md").exists() and not no_temporaries(run)


@case(2, "python -m moe.report RUN (a YAML slip in its .hydra/config.yaml)",
      "error: DIR={run!r} cannot be read: {run}/.hydra/config.yaml is not valid YAML at line 3, column 1 "
      "(while "
      "parsing a flow sequence at line 2, column 10: expected ',' or ']', but got '<stream end>'). Fix: "
      "restore "
      "config.yaml from a copy, or delete it: the report then uses what else the run dir holds")
def test_report_on_a_run_whose_hydra_config_yaml_has_a_syntax_error(tmp_path):
    from moe.tools.report import main

    run = fake_run(tmp_path)
    (run / ".hydra" / "config.yaml").write_text("model:\n  top_k: [2\n")
    code, err = exit_code_of(main, [str(run)])
    said(code, err, run=run)
    assert not (run / "report.md").exists()


@case(0, "python -m moe.report RUN (bytes that are not UTF-8 at the end of its metrics.csv)",
      "{run}/report.md")
def test_report_on_a_run_whose_metrics_csv_ends_in_bytes_that_are_not_utf8(tmp_path, capsys):
    """A node lost mid-write can leave noise at a file's end: UnicodeDecodeError. The rows that parse are
    reported; the noise makes no number."""
    from moe.tools.report import main

    run = fake_run(tmp_path)
    with open(run / "metrics.csv", "ab") as f:
        f.write(b"3,\xff\xfe\x00\x00")
    code, err = exit_code_of(main, [str(run)])
    said(code, capsys.readouterr().out + err, run=run)
    assert "| exp1 | 2 | 3.5000 |" in (run / "report.md").read_text()


def exit_code_of(main, argv) -> tuple[int, str]:
    """(exit status, stderr) of an argparse entry point's main(argv) run here."""
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    return code, err.getvalue()


def online_cache_entry(tmp_path: Path, monkeypatch) -> tuple[Path, list[str]]:
    """An online data cache entry built as train.py builds it (MOE_DATA_CACHE under tmp_path), and the
    overrides of a run that uses it."""
    from moe.data.datamodule import online_cache_dir, online_prep_config
    from moe.data.prep_pipeline import prepare

    (tmp_path / "corpus.txt").write_text("".join(f"document {i}: the quick brown fox.\n" for i in range(300)))
    monkeypatch.setenv("MOE_DATA_CACHE", str(tmp_path / "cache"))
    overrides = ["data=online", f"data.path={tmp_path / 'corpus.txt'}", f"data.tokenizer={SAMPLE_TOK}",
                 "data.seq_len=32"]
    prep = online_prep_config(compose_cfg(*overrides).data)
    prep.output = str(online_cache_dir(prep))
    return prepare(prep, progress=False), overrides


@case(2, "python train.py data=online ... (its cache entry's meta.json cut short)",
      "error: MOE_DATA_CACHE={cache!r} holds a damaged entry of the online data cache, {entry} (it has a "
      "damaged "
      "meta.json (...)). Fix: delete {cache}/{entry} (the next train.py start packs data.path into it "
      "again), "
      "or set MOE_DATA_CACHE to another directory")
def test_a_damaged_online_data_cache_entry_says_what_to_delete(tmp_path, monkeypatch):
    """It said data.path=<the cache entry> and to run data_prep.py into it with overwrite=true."""
    entry, overrides = online_cache_entry(tmp_path, monkeypatch)
    (entry / "meta.json").write_text((entry / "meta.json").read_text()[:100])
    before = snapshot(tmp_path / "cache")
    proc = run_entry("train.py", *overrides, f"hydra.run.dir={tmp_path / 'run'}", *FAST_RUN, here=True,
                     env={"MOE_DATA_CACHE": str(tmp_path / "cache")})
    said(proc.returncode, proc.stderr, cache=tmp_path / "cache", entry=entry.name)
    assert snapshot(tmp_path / "cache") == before and not (tmp_path / "run" / "checkpoints").exists()


@case(2, "python train.py data=online ... (a shard of its cache entry cut short)",
      "error: MOE_DATA_CACHE={cache!r} holds a damaged entry of the online data cache, {entry} (it cannot be "
      "read: a shard is missing, cut short or corrupt (...)). Fix: delete {cache}/{entry} ...")
def test_an_online_data_cache_entry_with_a_shard_cut_short_says_what_to_delete(tmp_path, monkeypatch):
    entry, overrides = online_cache_entry(tmp_path, monkeypatch)
    shard = next((entry / "train").glob("*.arrow"))
    shard.write_bytes(shard.read_bytes()[:1000])
    proc = run_entry("train.py", *overrides, f"hydra.run.dir={tmp_path / 'run'}", *FAST_RUN, here=True,
                     env={"MOE_DATA_CACHE": str(tmp_path / "cache")})
    said(proc.returncode, proc.stderr, cache=tmp_path / "cache", entry=entry.name)
    assert not (tmp_path / "run" / "checkpoints").exists()


@case(2, "python train.py hydra.run.dir=RUN (its rollbacks.json cut short)",
      "error: hydra.run.dir={run!r} cannot be read: {run}/rollbacks.json is not valid JSON at line 2, column "
      "1 "
      "(Expecting value). Fix: restore rollbacks.json from a copy; or, to forget the rollbacks (the batches "
      "they skipped are then trained again), delete it, or start the run afresh with resume=false")
def test_a_damaged_rollback_ledger_is_refused_before_training_starts(tmp_path):
    """The loss-spike guard read it at the fit's start: a JSONDecodeError, exit 1, which moe.supervise
    relaunched again and again."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "rollbacks.json").write_text('{"rollbacks": [\n')
    proc = run_entry("train.py", f"hydra.run.dir={run}", *FAST_RUN, "trainer.max_steps=2", here=True)
    said(proc.returncode, proc.stderr, run=run)
    assert (run / "rollbacks.json").read_text() == '{"rollbacks": [\n'
    assert not (run / "checkpoints").exists() and not (run / "metrics.csv").exists()


# ------------------------------------------------------------------------- an output that is an input
@case(2, "python infer.py ckpt=CKPT prompts_file=PROMPTS output_file=PROMPTS",
      "error: output_file={prompts!r} is prompts_file={prompts}, which this command reads: replacing it "
      "would "
      "destroy its own input. Fix: name another file for the completions: not prompts_file, nor a path "
      "inside it")
def test_infer_output_file_that_is_its_prompts_file_is_refused(ckpt, tmp_path):
    """The completions replaced the prompts."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("Once upon a time\n")
    proc = run_entry("infer.py", f"ckpt={ckpt}", f"prompts_file={prompts}", f"output_file={prompts}",
                     here=True)
    said(proc.returncode, proc.stderr, prompts=prompts)
    assert prompts.read_text() == "Once upon a time\n" and not no_temporaries(tmp_path)


@case(2, "python infer.py ckpt=CKPT prompt=hi output_file=CKPT",
      "error: output_file={ckpt!r} is ckpt={ckpt}, which this command reads: replacing it would destroy its "
      "own "
      "input. Fix: name another file for the completions: not ckpt, nor a path inside it")
def test_infer_output_file_that_is_its_checkpoint_is_refused(ckpt):
    """The completions replaced the checkpoint they were generated from."""
    before = ckpt.read_bytes()
    proc = run_entry("infer.py", f"ckpt={ckpt}", "prompt=hi", f"output_file={ckpt}", here=True)
    said(proc.returncode, proc.stderr, ckpt=ckpt)
    assert ckpt.read_bytes() == before


@case(2, "python infer.py ckpt=last prompt=hi output_file=RUN/metrics.csv",
      "error: output_file={out!r} lies inside {run}, which is a training run directory (checkpoints, "
      "metrics, "
      "config): nothing is written into a run. Fix: write the completions outside the run directory, e.g. "
      "next "
      "to it")
def test_infer_output_file_inside_a_training_run_is_refused(ckpt_file, tmp_path):
    """`ckpt=last output_file=runs/x/metrics.csv` replaced the run's metrics."""
    run = fake_run(tmp_path)
    (run / "checkpoints").mkdir()
    (run / "checkpoints" / "last.ckpt").write_bytes(ckpt_file.read_bytes())
    before = snapshot(tmp_path)
    proc = run_entry("infer.py", "ckpt=last", f"runs_dir={run.parent}", "prompt=hi",
                     f"output_file={run / 'metrics.csv'}", here=True)
    said(proc.returncode, proc.stderr, out=run / "metrics.csv", run=run)
    assert snapshot(tmp_path) == before


# ------------------------------------------------------------------------------------------- Ctrl-C
def ctrl_c(args: list[str], before_renaming: str, timeout: float = 240) -> tuple[int, str, str]:
    """Run `python args...` in a session of its own (as a terminal runs a command) and press Ctrl-C, a SIGINT
    to its whole process group as a terminal sends it, once it has written `before_renaming` under its
    temporary name; (exit status, stdout, stderr)."""
    from moe.faults import PAUSE_BEFORE_RENAME_ENV

    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
           "OMP_NUM_THREADS": "1", PAUSE_BEFORE_RENAME_ENV: before_renaming}
    proc = subprocess.Popen([sys.executable, *args], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    err, deadline = b"", time.monotonic() + timeout
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stderr, selectors.EVENT_READ)
        while not re.search(re.escape(PAUSE_BEFORE_RENAME_ENV.encode()) + b": .*\n", err):
            left = deadline - time.monotonic()
            if left <= 0 or (not sel.select(timeout=left)):
                proc.kill()
                raise AssertionError(f"never paused before renaming {before_renaming}: {err[-3000:]!r}")
            chunk = os.read(proc.stderr.fileno(), 65536)
            if not chunk:
                raise AssertionError(f"ended ({proc.wait()}) before renaming {before_renaming}: "
                                     f"{err[-3000:]!r}")
            err += chunk
    os.killpg(proc.pid, signal.SIGINT)
    out, rest = proc.communicate(timeout=120)
    return proc.returncode, out.decode(errors="replace"), (err + rest).decode(errors="replace")


@case(130, "python data_prep.py input=CORPUS output=OUT, Ctrl-C before OUT is renamed into place",
      "interrupted (Ctrl-C): {out} was not written (its temporary directory was removed; data already there "
      "is "
      "as it was)")
def test_ctrl_c_in_data_prep_leaves_no_output_and_no_temporary_directory(tmp_path):
    (tmp_path / "corpus.txt").write_text("".join(f"document {i}: the quick brown fox.\n" for i in range(300)))
    code, _, err = ctrl_c(["data_prep.py", f"input={tmp_path / 'corpus.txt'}", f"output={tmp_path / 'out'}",
                           f"tokenizer={SAMPLE_TOK}", "seq_len=16"], "out")
    said(code, err, out=tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["corpus.txt"]


@case(130, "python infer.py ckpt=CKPT prompt=... output_file=OUT, Ctrl-C before OUT is renamed into place",
      "interrupted (Ctrl-C): output_file={out} was not written (no temporary file was left); the completions "
      "are "
      "printed above")
def test_ctrl_c_in_infer_generation_leaves_no_output_file(ckpt, tmp_path):
    out = tmp_path / "completions.jsonl"
    code, stdout, err = ctrl_c(["infer.py", f"ckpt={ckpt}", "prompt=Once upon a time", "max_new_tokens=4",
                                f"output_file={out}"], out.name)
    said(code, err, out=out)
    assert "=== [0] Once upon a time" in stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


@case(130, "python infer.py ckpt=CKPT export_hf=OUT, Ctrl-C before OUT is renamed into place",
      "interrupted (Ctrl-C): export_hf={out} was not written (its temporary directory was removed; an export "
      "already there is as it was)")
def test_ctrl_c_in_infer_export_hf_leaves_no_export_and_no_temporary_directory(ckpt, tmp_path):
    out = tmp_path / "exported"
    code, _, err = ctrl_c(["infer.py", f"ckpt={ckpt}", f"export_hf={out}"], out.name)
    said(code, err, out=out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt"]


@case(130, "python -m moe.report RUN, Ctrl-C before RUN/report.md is renamed into place",
      "interrupted (Ctrl-C): the report is unfinished: each report.md and plot already written is whole, "
      "none "
      "was left half-written; run the same command again")
def test_ctrl_c_in_report_keeps_the_previous_report_whole(tmp_path):
    run = fake_run(tmp_path)
    (run / "report.md").write_text("# Run report: an earlier one\n")
    code, _, err = ctrl_c(["-m", "moe.report", str(run)], "report.md")
    said(code, err)
    assert (run / "report.md").read_text() == "# Run report: an earlier one\n" and not no_temporaries(run)


def _save_sharded(path: Path) -> None:
    """A sharded checkpoint directory as one rank writes it (a one-rank gloo group in this process)."""
    import torch.distributed as dist
    from conftest import free_port, restored_process_state
    from test_sharded_manifest import _save

    with restored_process_state():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
        _save(0, str(path))


@case(130, "python -m moe.tools.consolidate SRC OUT, Ctrl-C before OUT is renamed into place",
      "interrupted (Ctrl-C): OUT={out} was not written (no temporary file was left; a file already there is "
      "as "
      "it was)")
def test_ctrl_c_in_consolidate_leaves_no_half_written_checkpoint(tmp_path):
    """torch.save's temporary `OUT.tmp` was left beside OUT (only a refused write removed it)."""
    src, out = tmp_path / "step-000007.ckpt", tmp_path / "out" / "model.ckpt"
    _save_sharded(src)
    code, _, err = ctrl_c(["-m", "moe.tools.consolidate", str(src), str(out)], out.name)
    said(code, err, out=out)
    assert not out.parent.exists() or not list(out.parent.iterdir())


@pytest.mark.slow
@pytest.mark.serial  # Ctrl-C at a chosen moment
@case(130, "python train.py simulate=true, Ctrl-C before simulation.json is renamed into place",
      "interrupted (Ctrl-C): the simulation stopped; {run}/simulation.json was not written")
def test_ctrl_c_in_simulate_leaves_no_simulation_json(tmp_path):
    run = tmp_path / "run"
    code, _, err = ctrl_c(["train.py", "simulate=true", f"hydra.run.dir={run}"], "simulation.json")
    said(code, err, run=run)
    assert not (run / "simulation.json").exists() and not no_temporaries(run)


@pytest.mark.slow
@pytest.mark.serial  # Ctrl-C at a chosen moment
@case(130, "python train.py data=online ..., Ctrl-C while it packs its data at start-up",
      "interrupted (Ctrl-C): {entry} was not written (its temporary directory was removed; data already "
      "there "
      "is as it was)")
def test_ctrl_c_while_train_py_packs_online_data_leaves_no_cache_entry(tmp_path, monkeypatch):
    """Before the fit (which saves a checkpoint on Ctrl-C), a start-up that can take minutes: a traceback."""
    from moe.data.datamodule import online_cache_dir, online_prep_config

    (tmp_path / "corpus.txt").write_text("".join(f"document {i}: the quick brown fox.\n" for i in range(300)))
    monkeypatch.setenv("MOE_DATA_CACHE", str(tmp_path / "cache"))
    overrides = ["data=online", f"data.path={tmp_path / 'corpus.txt'}", f"data.tokenizer={SAMPLE_TOK}",
                 "data.seq_len=32"]
    entry = online_cache_dir(online_prep_config(compose_cfg(*overrides).data))
    code, _, err = ctrl_c(["train.py", *overrides, f"hydra.run.dir={tmp_path / 'run'}", *FAST_RUN],
                          entry.name)
    said(code, err, entry=entry)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())
    assert not (tmp_path / "run" / "checkpoints").exists()


# A command that counts the SIGINTs it gets, then exits as train.py does after a checkpointed stop.
COUNTS_SIGINTS = """
import signal, sys, time
got = []
signal.signal(signal.SIGINT, lambda *_: got.append(1))
print("ready", flush=True)
time.sleep(2)
print(f"got {len(got)} SIGINT(s)", flush=True)
sys.exit(130 if got else 0)
"""


@case(130, "python -m moe.supervise -- CMD, Ctrl-C at the terminal",
      "[{time}] supervise: stopped by SIGINT; the command ended with exit code 130; not restarting")
def test_ctrl_c_at_the_terminal_reaches_a_supervised_command_once(tmp_path):
    """The terminal signals the whole foreground group and the supervisor forwarded its copy too: train.py
    read the second SIGINT as "stop now, without a checkpoint"."""
    proc = subprocess.Popen([sys.executable, "-m", "moe.supervise", "--run-dir", str(tmp_path / "run"), "--",
                             sys.executable, "-c", COUNTS_SIGINTS], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert proc.stdout.readline() == "ready\n"
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    said(proc.returncode, err)
    assert out == "got 1 SIGINT(s)\n"


@case(130, "python -m moe.supervise --backoff 30 -- CMD (CMD crashed), Ctrl-C while it waits",
      "[{time}] supervise: stopped by SIGINT while waiting to relaunch; not restarting")
def test_ctrl_c_while_the_supervisor_waits_to_relaunch_stops_it_without_a_relaunch(tmp_path):
    """The signal set a flag that was read only after the wait and after one more launch of the command,
    whose exit status (1) the supervisor then returned."""
    launches = tmp_path / "launches"
    crash = f"import pathlib, sys; p = pathlib.Path({str(launches)!r}); p.write_text(p.read_text() + 'x' " \
            "if p.exists() else 'x'); sys.exit(1)"
    proc = subprocess.Popen([sys.executable, "-m", "moe.supervise", "--backoff", "30", "--run-dir",
                             str(tmp_path / "run"), "--", sys.executable, "-c", crash], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert "restart 1/10 in 30s" in proc.stderr.readline()
    started = time.monotonic()
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    said(proc.returncode, err)
    assert launches.read_text() == "x" and time.monotonic() - started < 20


# ------------------------------------------------------------------------------------------- the table
def around_table() -> str:
    """The cases as docs/FAULT_TOLERANCE.md shows them ("Around a run"): every test of this module, its
    command, exit status and the first line it asserts (`python tests/test_around_the_run.py` prints it)."""
    rows = []
    for name, test in globals().items():
        if not name.startswith("test_") or name == "test_the_doc_lists_every_case_around_a_run":
            continue
        code, command, first = getattr(test, "case", ("", "", f"see {name}"))
        first = re.sub(r"\{(\w+)!r\}", r"'{\1}'", first)
        rows.append((name[len("test_"):].replace("_", " "), command, code, first))
    from test_launch_world import table_rows as launcher_rows  # the launcher's world
    from test_relaunch import table_rows as relaunch_rows  # the resume contract

    rows += launcher_rows() + relaunch_rows()
    lines = ["| # | case | command | exit | first line (asserted) |", "|---|---|---|---|---|"]
    lines += [f"| {i} | {what} | {f'`{command}`' if command else ''} | {code} | `{first.replace('|', '/')}` |"
              for i, (what, command, code, first) in enumerate(rows, 1)]
    return "\n".join(lines) + "\n"


def test_the_doc_lists_every_case_around_a_run():
    table = around_table()
    assert table.count("\n") - 2 >= 15
    assert table in DOC.read_text(), "docs/FAULT_TOLERANCE.md is stale: python tests/test_around_the_run.py"


if __name__ == "__main__":
    print(around_table(), end="")
