"""The command line: help, unknown commands, and the demo's option checks (exit codes and messages)."""

import os
import subprocess
import sys

import pytest


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
