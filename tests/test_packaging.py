"""How breakgraph installs: its bindings cannot be shadowed, and a wheel holds the layout imports expect."""

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
    assert not any(name.startswith("bindings/") for name in names)
    assert any(name.endswith("licenses/LICENSE") or name.endswith("/LICENSE") for name in names)
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = "import breakgraph, breakgraph_bindings; print(breakgraph.__file__); print(breakgraph_bindings.__file__)"
    run = subprocess.run([sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(site)!r}); {code}"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert all(line.startswith(str(site)) for line in run.stdout.split())
