"""The package builds (``python -m build``: an sdist, then a wheel from it) with every module, its license and
package data, and the wheel check that ``.ci/run`` runs on it (``tests/wheel_check.py``) catches a wheel that lost a
subpackage (issue 38: a hand-written package list left out ``sage_lightning.policy`` and
``sage_lightning.kernels.hopper``)."""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import wheel_check

REPO = Path(__file__).resolve().parent.parent
#: What the build reads: the metadata, the package list, the two package folders (kernels/ is sage_lightning.kernels).
SOURCES = ("pyproject.toml", "setup.py", "README.md", "LICENSE", "sage_lightning", "kernels")


def _build(tmp_path: Path, drop: str | None = None) -> tuple[Path, Path]:
    """Build a wheel from a copy of the sources, ``drop`` (a file of the copy) removed; returns (wheel, copy)."""
    pytest.importorskip("build")
    project = tmp_path / "project"
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, project / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            project.mkdir(exist_ok=True)
            shutil.copy(source, project / name)
    if drop:
        (project / drop).unlink()
    # --no-isolation: the setuptools of this environment, no download (CI's `make test` is offline-ish).
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(project)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("sage_lightning-*.whl")
    return wheel, project


def _installed_check(wheel: Path, project: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    # The wheel's files alone, from a folder outside the checkout (not a venv: that is .ci/run's step, slower).
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    # This environment's editable install of the checkout would serve what the wheel lacks: its finder goes.
    code = (
        "import sys; sys.meta_path = [f for f in sys.meta_path if not getattr(f, '__module__', '').startswith("
        "'__editable__')]\n"
        "import wheel_check; from pathlib import Path; "
        f"problems = wheel_check.check_imports(Path({str(project)!r})); print(*problems, sep='\\n'); "
        "import sage_lightning; print('from', sage_lightning.__file__); sys.exit(1 if problems else 0)"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(unpacked), str(REPO / "tests")])}
    return subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)


def test_wheel_holds_every_module_its_license_and_package_data(tmp_path: Path) -> None:
    wheel, project = _build(tmp_path)
    assert wheel_check.check_contents(wheel, REPO) == []
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"sage_lightning/policy/engine.py", "sage_lightning/kernels/hopper/forward.py"} <= names
    assert "sage_lightning/py.typed" in names and "sage_lightning/gpu_record.json" in names
    (license_file,) = [name for name in names if name.endswith(".dist-info/licenses/LICENSE")]
    assert "Apache License" in zipfile.ZipFile(wheel).read(license_file).decode()
    (metadata_file,) = [name for name in names if name.endswith(".dist-info/METADATA")]
    metadata = email.message_from_bytes(zipfile.ZipFile(wheel).read(metadata_file))
    assert metadata["License-Expression"] == "Apache-2.0" and metadata["Name"] == "sage-lightning"
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "sage-lightning = sage_lightning.report:main" in zipfile.ZipFile(wheel).read(entry_points).decode()

    # The wheel alone imports every module (its own files, not this checkout's).
    done = _installed_check(wheel, project, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert f"from {tmp_path / 'unpacked'}" in done.stdout


def test_the_wheel_check_fails_on_a_wheel_that_lost_a_subpackage(tmp_path: Path) -> None:
    # A folder without its __init__.py is not found as a package: the build leaves kernels/hopper/ out.
    wheel, project = _build(tmp_path, drop="kernels/hopper/__init__.py")
    assert not any(name.startswith("sage_lightning/kernels/hopper/") for name in zipfile.ZipFile(wheel).namelist())
    (problem,) = wheel_check.check_contents(wheel, REPO)
    assert "in package(s) sage_lightning.kernels.hopper:" in problem and "hopper/forward.py" in problem
    done = _installed_check(wheel, project, tmp_path)
    assert done.returncode == 1
    assert (
        "import sage_lightning.kernels: ImportError: sage_lightning.kernels: the Triton kernels failed" in done.stdout
    )


def test_the_wheel_check_names_stray_top_level_folders(tmp_path: Path) -> None:
    wheel = tmp_path / "stray-0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for name in wheel_check.expected_files(REPO):
            archive.writestr(name, "")
        archive.writestr("kernels/forward.py", "")
    (problem,) = wheel_check.check_contents(wheel, REPO)
    assert "as top-level packages: kernels/forward.py" in problem


def test_the_readme_example_is_found() -> None:
    block = wheel_check.readme_example(REPO)
    assert "AdaptivePrecision(" in block and "SageAttentionMixin" in block


def test_ci_checks_the_installed_wheel() -> None:
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r'wheel_check\.py"? contents', ci) and re.search(r'wheel_check\.py"? installed', ci)
    assert "pip wheel" in ci and "--no-deps" in ci
