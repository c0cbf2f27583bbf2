"""The package builds (``python -m build``: an sdist, then a wheel from it) with its license and package data."""

from __future__ import annotations

import email
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
#: What the build reads: the metadata, the two package folders (kernels/ is installed as sage_lightning.kernels).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "sage_lightning", "kernels")


def test_wheel_builds_with_license_and_package_data(tmp_path: Path) -> None:
    pytest.importorskip("build")
    project = tmp_path / "project"
    for name in SOURCES:
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, project / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            project.mkdir(exist_ok=True)
            shutil.copy(source, project / name)
    # --no-isolation: the setuptools of this environment, no download (CI's `make test` is offline-ish).
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(tmp_path / "dist"), str(project)],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (wheel,) = (tmp_path / "dist").glob("sage_lightning-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    expected = {
        f"sage_lightning/{p.relative_to(REPO / 'sage_lightning')}" for p in (REPO / "sage_lightning").glob("*.py")
    }
    expected |= {f"sage_lightning/kernels/{p.name}" for p in (REPO / "kernels").glob("*.py")}
    expected.add("sage_lightning/py.typed")
    assert expected <= names, sorted(expected - names)
    assert not any(name.startswith(("tests/", "examples/", "benchmarks/", "kernels/")) for name in names)
    (license_file,) = [name for name in names if name.endswith(".dist-info/licenses/LICENSE")]
    assert "Apache License" in zipfile.ZipFile(wheel).read(license_file).decode()
    (metadata_file,) = [name for name in names if name.endswith(".dist-info/METADATA")]
    metadata = email.message_from_bytes(zipfile.ZipFile(wheel).read(metadata_file))
    assert metadata["License-Expression"] == "Apache-2.0" and metadata["Name"] == "sage-lightning"

    # The wheel alone imports (its own files, not this checkout's).
    unpacked = tmp_path / "unpacked"
    zipfile.ZipFile(wheel).extractall(unpacked)
    check = "import sage_lightning, sage_lightning.kernels as k; print(sage_lightning.__file__, k.__file__)"
    done = subprocess.run([sys.executable, "-c", check], cwd=tmp_path, env={"PYTHONPATH": str(unpacked)},
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert all(path.startswith(str(unpacked)) for path in done.stdout.split()), done.stdout
