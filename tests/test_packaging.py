"""How breakgraph installs: its bindings cannot be shadowed, and a wheel holds the layout imports expect."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_a_bindings_folder_in_the_working_directory_does_not_shadow_breakgraph(tmp_path):
    (tmp_path / "bindings").mkdir()
    (tmp_path / "bindings" / "__init__.py").write_text("raise ImportError('the user\\'s own bindings package')\n")
    (tmp_path / "bindings.py").write_text("raise ImportError('the user\\'s own bindings module')\n")
    code = "import breakgraph, breakgraph_bindings; print(breakgraph.__file__); print(breakgraph_bindings.__file__)"
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    engine, bindings = (Path(line) for line in run.stdout.split())
    assert tmp_path not in bindings.parents  # not the user's folder
    assert bindings.parents[1] == engine.parents[1]  # the bindings installed with this breakgraph


def test_a_wheel_installs_breakgraph_and_breakgraph_bindings_and_they_import(tmp_path):
    try:
        import setuptools  # noqa: F401  (build without isolation: no network needed)

        isolation = ["--no-build-isolation"]
    except ImportError:
        isolation = []
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(tmp_path), str(ROOT)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if build.returncode != 0 and "setuptools>=77" in build.stderr + build.stdout:
        pytest.skip("this environment's setuptools is older than the build needs, and there is no network")
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = tmp_path.glob("breakgraph-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "breakgraph/__init__.py" in names and "breakgraph_bindings/__init__.py" in names
    assert "breakgraph/hf/__init__.py" in names and "breakgraph/hf/generation.py" in names  # subpackages too
    assert not any(name.startswith("bindings/") for name in names)
    assert any(name.endswith("licenses/LICENSE") or name.endswith("/LICENSE") for name in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = "import breakgraph, breakgraph_bindings; print(breakgraph.__file__); print(breakgraph_bindings.__file__)"
    run = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert all(line.startswith(str(site)) for line in run.stdout.split())


def _readme_command(name: str) -> str:
    """The README's one-line command that ends with ``name``."""
    readme = (ROOT / "README.md").read_text()
    (line,) = [line for line in readme.splitlines() if line.startswith("python3 -m pip install -e") and line.endswith(name)]
    return line


def _environment_sharing_this_ones_packages(venv: Path) -> str:
    """A fresh virtual environment whose packages are this environment's (torch, setuptools, pip),
    found after its own: its Python, without network.

    ``venv --system-site-packages`` would not do: made from a Python that runs in a virtual
    environment, it shows the *base* interpreter's packages, not this environment's."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    own = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], capture_output=True, text=True, check=True)
    ours = [entry for entry in sys.path if Path(entry).name in ("site-packages", "dist-packages")]
    (Path(own.stdout.strip()) / "this_environment.pth").write_text("".join(f"{entry}\n" for entry in ours))
    return python


def test_an_editable_install_imports_from_the_folder_that_holds_the_checkout(tmp_path):
    """A clone named breakgraph/, installed editable as the README says, then Python run in the
    folder above it: that folder's breakgraph/ (the checkout, no __init__.py) must not be
    imported as an empty namespace package ahead of the installed breakgraph."""
    clone = tmp_path / "breakgraph"
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", ".*cache*", ".hypothesis", "results", ".scratch", ".whl", ".venv*", "venv*"))
    python = _environment_sharing_this_ones_packages(tmp_path / "venv")
    setuptools = subprocess.run([python, "-c", "import setuptools; print(setuptools.__version__)"], capture_output=True, text=True)
    if setuptools.returncode != 0 or int(setuptools.stdout.split(".")[0]) < 77:
        pytest.skip(f"the build needs setuptools>=77 and there is no network; this environment has {setuptools.stdout.strip() or 'none'}")
    flags = _readme_command("python3 -m pytest -q").split("&&")[0].split('".[test,plot,transformers]"')[1].split()
    install = subprocess.run(
        [python, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "-e", str(clone), *flags],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert install.returncode == 0, install.stdout + install.stderr
    code = "import breakgraph as bg, breakgraph_bindings as b; bg.graphed; print(bg.__file__); print(b.__file__)"
    run = subprocess.run([python, "-c", code], cwd=tmp_path, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    engine, bindings = (Path(line) for line in run.stdout.split())
    assert clone in engine.parents and clone in bindings.parents  # this clone's code, through the install
