"""The command line: help, unknown commands and options, the version line, and the demo's option checks (exit codes and messages)."""

import os
import subprocess
import sys

import pytest

from breakgraph.base.runtime import cuda_available


def breakgraph(*args) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.getcwd())
    return subprocess.run([sys.executable, "-m", "breakgraph", *args], capture_output=True, text=True, env=env, timeout=120)


def test_help_lists_the_commands_and_exits_0():
    run = breakgraph("--help")
    assert run.returncode == 0
    assert "demo" in run.stdout and "commands" in run.stdout


def test_demo_help_explains_every_option():
    run = breakgraph("demo", "--help")
    assert run.returncode == 0
    for option, words in [("--batch", "sequences per step"), ("--seq", "tokens"), ("--iters", "timed steps"), ("--plot", "GPU only")]:
        assert option in run.stdout and words in run.stdout


def test_no_command_prints_help_and_exits_2():
    run = breakgraph()
    assert run.returncode == 2 and "demo" in run.stdout


def test_unknown_command_is_named():
    run = breakgraph("frob")
    assert run.returncode == 2
    assert "unknown command 'frob'" in run.stderr and "demo" in run.stderr


@pytest.mark.parametrize("option, value", [("--iters", "0"), ("--batch", "0"), ("--seq", "-1"), ("--batch", "two")])
def test_demo_rejects_bad_numbers_before_running(option, value):
    run = breakgraph("demo", option, value)
    assert run.returncode == 2
    assert f"argument {option}: must be a positive whole number, got {value!r}" in run.stderr
    assert "_positive" not in run.stderr  # no internal name


def refused(capsys, *args) -> str:
    """What ``python3 -m breakgraph *args`` says on stderr as it leaves with status 2, run in this process."""
    from breakgraph.__main__ import main

    with pytest.raises(SystemExit) as leaving:
        main(list(args))
    out, err = capsys.readouterr()
    assert leaving.value.code == 2 and out == ""  # refused before the demo said or did anything
    return err


@pytest.mark.parametrize(
    "args, usage, message",
    [
        (["demo", "--steps", "3"], "usage: python3 -m breakgraph demo", "unrecognized arguments: --steps 3; did you mean --iters?"),
        (["demo", "--iters=3", "--sq=4"], "usage: python3 -m breakgraph demo", "unrecognized arguments: --sq=4; did you mean --seq?"),
        (["demo", "--itres", "3", "--bach", "2"], "usage: python3 -m breakgraph demo", "did you mean --iters for --itres, --batch for --bach?"),
        (["demo", "--x", "1"], "usage: python3 -m breakgraph demo", "unrecognized arguments: --x 1; the options are --help, --batch, --seq, --iters, --plot"),
        (["--verison"], "usage: python3 -m breakgraph [", "unrecognized arguments: --verison; did you mean --version?"),
    ],
)
def test_an_unknown_option_is_answered_with_the_closest_known_one(capsys, args, usage, message):
    err = refused(capsys, *args)
    assert err.startswith(usage) and message in err


def test_a_plot_path_that_cannot_be_written_is_refused_before_the_run(capsys, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    err = refused(capsys, "demo", "--plot", str(blocker / "plots" / "x.png"))
    assert (
        f"argument --plot: cannot write {blocker / 'plots' / 'x.png'}: {blocker / 'plots'} cannot be made: {blocker} is a file; "
        "give --plot a path in a folder you can write"
    ) in err
    err = refused(capsys, "demo", "--plot", str(tmp_path))
    assert f"argument --plot: {tmp_path} is a folder; give --plot a file in it, e.g. {tmp_path / 'breakgraph_profile.png'}" in err


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
def test_a_plot_folder_that_cannot_be_made_is_refused_before_the_run(capsys):
    err = refused(capsys, "demo", "--plot", "/proc/nonexistent/x.png")
    assert (
        "argument --plot: cannot write /proc/nonexistent/x.png: /proc/nonexistent does not exist and cannot be made in /proc "
        "(No such file or directory); give --plot a path in a folder you can write"
    ) in err


def test_a_folder_is_writable_where_it_can_be_made_and_is_not_made_by_the_check(tmp_path):
    from breakgraph.base.command_line import write_problem

    missing = tmp_path / "new" / "plots"
    assert write_problem(missing) is None and write_problem(tmp_path) is None
    assert not (tmp_path / "new").exists() and list(tmp_path.iterdir()) == []  # the probe left nothing behind


def test_version_says_which_gpu_is_visible():
    import torch

    run = breakgraph("--version")
    assert run.returncode == 0, run.stderr
    line = run.stdout.strip()
    assert line.startswith("breakgraph ") and "\n" not in line
    if torch.cuda.is_available():
        assert f"; GPU: {torch.cuda.get_device_name(0)}" in line
    else:
        assert "; no CUDA GPU visible" in line


@pytest.mark.parametrize(
    "cuda, names, expected",
    [
        (None, [], "no CUDA GPU visible (torch {version} is built without CUDA)"),
        ("13.0", [], "no CUDA GPU visible"),
        ("13.0", ["NVIDIA H100 80GB HBM3"], "GPU: NVIDIA H100 80GB HBM3"),
        ("13.0", ["NVIDIA H100 80GB HBM3"] * 8, "GPU: NVIDIA H100 80GB HBM3 (device 0 of 8)"),
    ],
)
def test_the_gpu_line_names_the_gpu_or_says_why_there_is_none(monkeypatch, cuda, names, expected):
    import torch

    from breakgraph.__main__ import gpu_line

    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(names))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index: names[index])
    assert gpu_line() == expected.format(version=torch.__version__)


def test_the_gpu_line_reports_a_driver_torch_cannot_use_without_failing(monkeypatch):
    import torch

    from breakgraph.__main__ import gpu_line

    def broken():
        raise RuntimeError("The NVIDIA driver on your system is too old (found version 11040).\nPlease update your GPU driver")

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", broken)
    assert gpu_line() == "no CUDA GPU usable (The NVIDIA driver on your system is too old (found version 11040).)"


def _demo_in_proc() -> subprocess.CompletedProcess:
    """The demo run from /proc, where no file can be made: the default plot path cannot be written."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "breakgraph", "demo", "--iters", "2"]
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd="/proc", timeout=300)


@pytest.mark.skipif(cuda_available() or not os.path.isdir("/proc/self"), reason="the no-GPU path, in Linux's /proc")
def test_without_a_gpu_the_demo_runs_where_its_default_plot_could_not_be_written():
    run = _demo_in_proc()
    assert run.returncode == 0, run.stderr
    assert "no profile plot was written" in run.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc, where no file can be made")
def test_on_a_gpu_the_demo_refuses_a_default_plot_path_it_cannot_write_before_it_captures():
    run = _demo_in_proc()
    assert run.returncode == 2, run.stdout + run.stderr
    assert "the profile plot's default path: cannot write breakgraph_profile.png" in run.stderr
    assert "captured:" not in run.stdout
