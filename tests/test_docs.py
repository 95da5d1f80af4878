"""The README and docs/ as a reader meets them: every Python block runs as written, pasted alone
into a fresh interpreter, on the machine its first line names ("Runs anywhere" blocks here and on a
GPU machine, where they capture; "Needs a CUDA GPU" blocks on a GPU; "Needs 2 CUDA GPUs" blocks
under torchrun); every relative link leads somewhere; and CI runs the README's two commands."""

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from breakgraph.base.runtime import cuda_available
from tests.launch import torchrun

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
FENCED = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.DOTALL | re.MULTILINE)
WHERE = {
    "# Runs anywhere": "anywhere",
    "# Needs a CUDA GPU": "gpu",
    "# Needs 2 CUDA GPUs": "2 gpus",
}
STALLED_S = 240
DEMO = 'python3 -m pip install -e ".[test,plot,transformers]" --config-settings editable_mode=strict && python3 -m breakgraph demo'
TESTS = 'python3 -m pip install -e ".[test,plot,transformers]" --config-settings editable_mode=strict && lint-imports && python3 -m pytest -q'


def python_blocks() -> list[tuple[str, str]]:
    """(page and index, code) of every ```python block of the README and docs/."""
    return [
        (f"{page.relative_to(ROOT)}:{index}", code)
        for page in PAGES
        for index, (language, code) in enumerate(FENCED.findall(page.read_text()))
        if language == "python"
    ]


def where(block: str) -> str | None:
    first = block.splitlines()[0]
    return next((kind for prefix, kind in WHERE.items() if first.startswith(prefix)), None)


def blocks(kind: str) -> list:
    return [pytest.param(code, id=name) for name, code in python_blocks() if where(code) == kind]


def run(block: str, tmp_path: Path, command: list[str] | None = None) -> None:
    script = tmp_path / "block.py"
    script.write_text(block)
    done = subprocess.run(
        command or [sys.executable, str(script)],
        cwd=tmp_path,  # a fresh folder: the block finds breakgraph as an installed user would
        env=dict(os.environ, PYTHONWARNINGS="ignore"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, f"this block failed:\n{block}\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"


def test_every_python_block_says_where_it_runs():
    assert len(python_blocks()) >= 9  # the pattern found the blocks
    unlabelled = [name for name, code in python_blocks() if where(code) is None]
    assert not unlabelled, f"blocks whose first line does not say where they run: {unlabelled}"


@pytest.mark.parametrize("block", blocks("anywhere"))
def test_a_block_that_runs_anywhere_runs_here(block, tmp_path):
    run(block, tmp_path)


@pytest.mark.gpu
@pytest.mark.parametrize("block", blocks("gpu"))
def test_a_gpu_block_runs_on_a_gpu(block, tmp_path):
    run(block, tmp_path)


@pytest.mark.gpu
@pytest.mark.skipif(cuda_available() and torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
@pytest.mark.parametrize("block", blocks("2 gpus"))
def test_a_two_gpu_block_runs_under_torchrun(block, tmp_path):
    # A rank still running after STALLED_S prints its stack and ends, so a stalled block shows where.
    (tmp_path / "block.py").write_text(f"import faulthandler; faulthandler.dump_traceback_later({STALLED_S}, exit=True)\n{block}")
    status, log = torchrun([str(tmp_path / "block.py")], 2, tmp_path, STALLED_S + 60, dict(os.environ, PYTHONWARNINGS="ignore"))
    assert status == 0, f"this block failed or stalled:\n{block}\n{log[-6000:]}"


def the_readme_example() -> tuple[int, str]:
    """The README's first Python block: the line it starts on, and its code."""
    text = README.read_text()
    found = re.search(r"^```python\n(.*?)^```", text, flags=re.DOTALL | re.MULTILINE)
    return text[: found.start()].count("\n") + 1, found.group(1)


def test_the_readme_is_a_guide_that_shows_an_example_early():
    assert len(README.read_text().splitlines()) <= 400
    line, code = the_readme_example()
    assert line <= 60 and len(code.splitlines()) <= 15 and where(code) == "anywhere"


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    prose = FENCED.sub("", page.read_text())
    return {github_anchor(heading) for heading in re.findall(r"^#+ (.+)$", prose, flags=re.MULTILINE)}


def relative_links(page: Path) -> list[str]:
    prose = re.sub(r"`[^`\n]*`", "", FENCED.sub("", page.read_text()))
    return [target for target in re.findall(r"\]\(([^)\s]+)\)", prose) if not re.match(r"[a-z]+:", target)]


@pytest.mark.parametrize("page", PAGES, ids=[str(page.relative_to(ROOT)) for page in PAGES])
def test_every_relative_link_leads_to_a_file_and_heading_that_exist(page):
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists():
            broken.append(f"{target}: no file {linked}")
        elif anchor and anchor not in anchors(linked):
            broken.append(f"{target}: no heading with the anchor #{anchor} in {linked.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)} links to what is not there:\n" + "\n".join(broken)


def test_the_anchor_rule_is_githubs():
    assert github_anchor("Against transformers' static cache and torch.compile") == "against-transformers-static-cache-and-torchcompile"
    assert github_anchor("torch 2.12 and newer") == "torch-212-and-newer"
    assert github_anchor("GraphRunner: one graph per batch size") == "graphrunner-one-graph-per-batch-size"
    assert github_anchor("Writeback: what breaks may return") == "writeback-what-breaks-may-return"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / link.partition("#")[0]).resolve() for link in relative_links(README)}
    assert not [page.name for page in PAGES[1:] if page.resolve() not in linked]


# Spelled with \s+ so that these patterns do not find themselves.
HISTORY = (r"this\s+session", r"issue\s+[0-9]+", r"\bat [0-9a-f]{7,40}\b", r"work\s+in\s+progress")
PROJECT_TEXTS = sorted(
    path
    for folder in ("breakgraph", "bindings", "benchmarks", "examples", "tests", "docs", ".ci")
    for path in (ROOT / folder).rglob("*")
    if path.is_file() and (path.suffix in (".py", ".md", ".toml") or path.parent.name == ".ci")
) + [README, ROOT / "pyproject.toml"]


@pytest.mark.parametrize("path", PROJECT_TEXTS, ids=[str(path.relative_to(ROOT)) for path in PROJECT_TEXTS])
def test_the_project_speaks_of_breakgraph_not_of_how_it_was_made(path):
    text = path.read_text()
    for pattern in HISTORY:
        found = re.search(pattern, text, flags=re.IGNORECASE)
        assert not found, f"{path.relative_to(ROOT)} says {found.group()!r}"


def the_two_commands() -> list[str]:
    """The ```bash blocks of the README's section "## The two commands"."""
    section = re.search(r"^## The two commands\n(.*?)(?=^## )", README.read_text(), flags=re.DOTALL | re.MULTILINE).group(1)
    return [code.strip() for language, code in FENCED.findall(section) if language == "bash"]


def test_the_readme_holds_the_two_commands():
    assert the_two_commands() == [DEMO, TESTS]


def fake(path: Path, log: Path, fails_on: str = "") -> None:
    """A stand-in for a program that logs its name and arguments, one JSON list a line, and
    fails when its arguments hold ``fails_on``."""
    path.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"with open({str(log)!r}, 'a') as log:\n"
        "    log.write(json.dumps([os.path.basename(sys.argv[0]), *sys.argv[1:]]) + '\\n')\n"
        f"sys.exit(1 if {fails_on!r} and {fails_on!r} in sys.argv else 0)\n"
    )
    path.chmod(0o755)


def run_ci(tmp_path: Path, fails_on: str = "") -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """.ci/run on a copy of this checkout's README, with python3 and lint-imports stand-ins that log
    what they are asked to do: every command .ci/run runs, in order, without a network."""
    checkout, programs, log = tmp_path / "checkout", tmp_path / "programs", tmp_path / "log"
    (checkout / ".ci").mkdir(parents=True)
    programs.mkdir()
    shutil.copy(ROOT / ".ci" / "run", checkout / ".ci" / "run")
    shutil.copy(README, checkout / "README.md")
    shutil.copy(ROOT / "pyproject.toml", checkout / "pyproject.toml")
    for program in ("python3", "lint-imports"):
        fake(programs / program, log, fails_on)
    done = subprocess.run(
        ["bash", str(checkout / ".ci" / "run")],
        env=dict(os.environ, PATH=f"{programs}{os.pathsep}{os.environ['PATH']}"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    calls = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    return done, calls


def test_ci_runs_the_readme_commands_in_a_fresh_environment_then_the_oldest_transformers(tmp_path):
    done, calls = run_ci(tmp_path)
    assert done.returncode == 0, done.stderr
    (venv, torch_cpu, *rest) = calls
    assert venv[:3] == ["python3", "-m", "venv"]  # a fresh virtual environment, made first
    assert torch_cpu == ["python3", "-m", "pip", "install", "torch==2.13.0"]  # then torch's CPU build, pinned
    readme = [shlex.split(step) for command in the_two_commands() for step in command.split("&&")]
    assert rest[: len(readme)] == readme  # then exactly the README's commands, in its order
    oldest = re.search(r'"transformers>=([0-9.]+),', (ROOT / "pyproject.toml").read_text()).group(1)
    assert rest[len(readme) :] == [  # then the extra's oldest transformers, on breakgraph.hf's tests
        ["python3", "-m", "pip", "install", f"transformers=={oldest}"],
        ["python3", "-m", "pytest", "-q", "tests/test_hf.py", "tests/test_hf_sdpa.py", "tests/test_hf_sampling.py", "tests/test_hf_compiled.py"],
    ]


def test_ci_fails_when_a_readme_command_fails(tmp_path):
    done, calls = run_ci(tmp_path, fails_on="pytest")
    assert done.returncode != 0
    assert calls[-1][-3:] == ["-m", "pytest", "-q"]  # the README's test command, and nothing after it
