"""`python -m moe.supervise -- CMD` relaunches a crashed command with back-off and logs each restart."""
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, compose_cfg

from moe.tools import supervise
from moe.tools.supervise import Supervisor, prepare_command, relaunch_command

# Counts its launches in a file; crashes (SIGKILL itself, or exit CODE) until launch N succeeds.
FLAKY = textwrap.dedent("""
    import os, signal, sys
    counter, succeed_on, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    n = int(open(counter).read()) + 1 if os.path.exists(counter) else 1
    open(counter, "w").write(str(n))
    print("launch", n, " ".join(sys.argv[4:]), flush=True)
    if n >= succeed_on:
        sys.exit(0)
    if how == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(how))
""")


def supervise_cli(tmp_path, *opts, succeed_on=3, how="kill", extra=()):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    counter = tmp_path / "count"
    cmd = [sys.executable, "-m", "moe.supervise", "--run-dir", str(tmp_path / "run"), *opts, "--",
           sys.executable, str(script), str(counter), str(succeed_on), how, *extra]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    launches = int(counter.read_text()) if counter.exists() else 0
    return proc, launches


def test_relaunches_after_sigkill_until_success_and_logs_each_restart(tmp_path):
    proc, launches = supervise_cli(tmp_path, "--max-restarts", "5", "--backoff", "0", succeed_on=3)
    assert proc.returncode == 0, proc.stderr
    assert launches == 3
    log = (tmp_path / "run" / "restarts.log").read_text().splitlines()
    assert len(log) == 3  # two restarts, then "finished after 2 restart(s)"
    assert "killed by SIGKILL; restart 1/5 in 0s" in log[0]
    assert "killed by SIGKILL; restart 2/5 in 0s" in log[1]
    assert "finished after 2 restart(s)" in log[2]
    assert "restart 1/5" in proc.stderr and "restart 2/5" in proc.stderr


def test_gives_up_after_max_restarts_with_the_commands_exit_code(tmp_path):
    proc, launches = supervise_cli(tmp_path, "--max-restarts", "2", "--backoff", "0", succeed_on=99, how="7")
    assert proc.returncode == 7
    assert launches == 3  # the first launch and two restarts
    log = (tmp_path / "run" / "restarts.log").read_text()
    assert "giving up after 2 restart(s)" in log and "exit code 7" in log


def test_a_user_error_is_not_retried(tmp_path):
    proc, launches = supervise_cli(tmp_path, "--max-restarts", "5", "--backoff", "0", succeed_on=99, how="2")
    assert proc.returncode == 2 and launches == 1
    assert "not restarting: the command failed with a user error" in proc.stderr


def test_backoff_doubles_up_to_the_cap(tmp_path, monkeypatch):
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY)
    waits = []
    monkeypatch.setattr(supervise.time, "sleep", waits.append)
    sup = Supervisor([sys.executable, str(script), str(tmp_path / "count"), "5", "3"], max_restarts=10,
                     backoff=1.5, max_backoff=5.0, run_dir=tmp_path / "run")
    assert sup.run() == 0
    assert waits == [1.5, 3.0, 5.0, 5.0]


def test_sigterm_to_the_supervisor_reaches_the_command_and_stops_relaunching(tmp_path):
    started = tmp_path / "started"
    child = f"import pathlib, time; pathlib.Path({str(started)!r}).write_text('x'); time.sleep(120)"
    proc = subprocess.Popen([sys.executable, "-m", "moe.supervise", "--run-dir", str(tmp_path / "run"),
                             "--backoff", "0", "--", sys.executable, "-c", child],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not started.exists():
        assert time.time() < deadline and proc.poll() is None
        time.sleep(0.1)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in err and "not restarting" in err


def test_a_train_command_is_relaunched_as_it_is_into_the_run_dir_it_composes():
    """No run name is added: the default one is the experiment's, the same at every launch."""
    cmd, run_dir = prepare_command(["python", "train.py", "model=tiny_switch"])
    assert cmd == ["python", "train.py", "model=tiny_switch"]
    expected = compose_cfg("model=tiny_switch").run_name
    assert run_dir == supervise.Path("runs", expected).absolute() and expected.startswith("tiny_switch-")

    cmd, run_dir = prepare_command(["python", "train.py", "run_name=big", "resume=false"])
    assert cmd == ["python", "train.py", "run_name=big", "resume=false"]
    assert run_dir == supervise.Path("runs/big").absolute()
    assert relaunch_command(cmd) == ["python", "train.py", "run_name=big", "resume=true"]

    assert prepare_command(["torchrun", "--nproc_per_node=2", "train.py", "hydra.run.dir=/tmp/x"])[1] == \
        supervise.Path("/tmp/x")
    typo = ["python", "train.py", "model=nope"]
    assert prepare_command(typo) == (typo, None)  # train.py itself will say what is wrong
    assert prepare_command(["bash", "job.sh"]) == (["bash", "job.sh"], None)


@pytest.mark.parametrize("argv, needle", [
    ([], "command='' is missing"),
    (["--", "python", "train.py", "-m", "moe_opt.capacity_factor=1,2"], "command='-m'"),
    (["--max-restarts", "-1", "--", "true"], "--max-restarts=-1"),
])
def test_bad_supervisor_usage_exits_2_with_the_fix(argv, needle, capsys):
    assert supervise.main(argv) == 2
    err = capsys.readouterr().err
    assert needle in err and "Fix:" in err


def test_module_help_runs():
    out = subprocess.run([sys.executable, "-m", "moe.supervise", "--help"], cwd=REPO, capture_output=True,
                         text=True, env={**os.environ}, timeout=60)
    assert out.returncode == 0 and "--max-restarts" in out.stdout
