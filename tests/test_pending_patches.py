"""Kernel work parked in ``benchmarks/pending/`` (patches waiting for a device session) still applies to main.

A parked patch that no longer applies costs a device session its first call; this finds it on the CPU, when main
changes under it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PATCHES = sorted((REPO / "benchmarks" / "pending").glob("*.patch"))


def test_every_parked_patch_is_listed_in_the_pending_readme() -> None:
    readme = (REPO / "benchmarks" / "pending" / "README.md").read_text()
    assert [p.name for p in PATCHES if f"`{p.name}`" not in readme] == []


def prerequisites(patch: Path) -> list[Path]:
    """The parked patches ``patch`` is stacked on, in order: its header's ``Applies after: a.patch, b.patch`` line
    (``git apply`` skips the text before the first diff)."""
    for line in patch.read_text().splitlines():
        if line.startswith("diff --git"):
            break
        if line.startswith("Applies after:"):
            return [patch.parent / name.strip() for name in line.partition(":")[2].split(",")]
    return []


def standalone() -> list[Path]:
    """The parked patches that apply to main by themselves (the device script's tests use them)."""
    return [patch for patch in PATCHES if not prerequisites(patch)]


def applied_copy(patch: Path, dest: Path, check_only: bool = False) -> tuple[subprocess.CompletedProcess, list[str]]:
    """Copies into ``dest`` the files ``patch`` and its prerequisites touch, applies the prerequisites, then ``patch``
    (only checked with ``check_only``); returns that last ``git apply`` and the files ``patch`` touches."""
    dest.mkdir(parents=True, exist_ok=True)
    touched: dict[Path, list[str]] = {}
    for one in [*prerequisites(patch), patch]:
        numstat = subprocess.run(["git", "apply", "--numstat", str(one)], cwd=REPO, capture_output=True, text=True)
        touched[one] = [line.split("\t")[-1] for line in numstat.stdout.splitlines()]
    for name in {name for names in touched.values() for name in names}:
        if (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / name, dest / name)
    for one in prerequisites(patch):
        subprocess.run(["git", "apply", str(one)], cwd=dest, check=True, capture_output=True)
    last = ["git", "apply", *(["--check"] if check_only else []), str(patch)]
    return subprocess.run(last, cwd=dest, capture_output=True, text=True), touched[patch]


@pytest.mark.skipif(shutil.which("git") is None, reason="git applies the patches")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_parked_patch_applies_to_this_tree(patch: Path, tmp_path: Path) -> None:
    """To main, or to main with the parked patches it names as applied before it."""
    done, _ = applied_copy(patch, tmp_path, check_only=True)
    assert done.returncode == 0, f"{patch.name} no longer applies: {done.stderr}"


def test_the_device_script_parses() -> None:
    subprocess.run(["bash", "-n", str(REPO / "benchmarks" / "pending" / "check_patch.sh")], check=True)


@pytest.mark.skipif(shutil.which("git") is None, reason="git applies the patches")
@pytest.mark.parametrize("patch", PATCHES, ids=[p.name for p in PATCHES])
def test_parked_patch_applied_passes_the_linter(patch: Path, tmp_path: Path) -> None:
    """CI lints the tree: a parked patch, once applied (after its prerequisites), must not be what fails it (the files
    it touches, patched in a copy, under the repository's ruff settings)."""
    pytest.importorskip("ruff")  # the linter CI runs, from the dev extra
    done, files = applied_copy(patch, tmp_path)
    assert done.returncode == 0, done.stderr
    python = [p for p in files if p.endswith(".py") and (tmp_path / p).is_file()]
    config = ["--config", str(REPO / "pyproject.toml")]
    for check in (["check", *config], ["format", "--check", *config]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *check, *python], cwd=tmp_path, capture_output=True, text=True
        )
        assert done.returncode == 0, (
            f"{patch.name}, applied: ruff {check[0]}:\n{done.stdout[-3000:]}{done.stderr[-1000:]}"
        )


STUB_PYTHON = """#!/usr/bin/env bash
echo "GIT_COMMIT=${GIT_COMMIT:-} GPU=${CUDA_VISIBLE_DEVICES:-} $*" >> "$STUB_LOG"
for ((i = 1; i < $#; i++)); do [[ "${!i}" == --out ]] && { j=$((i + 1)); touch "${!j}"; }; done
exit 0
"""
SCRIPT = ["bash", str(REPO / "benchmarks" / "pending" / "check_patch.sh")]


def run_detached(tmp_path: Path, patches: str, **settings: str) -> dict[str, str]:
    """check_patch.sh with DETACH=1 on ``patches`` against main "abc123", its python3 and nvidia-smi stubbed (each
    python3 call logged to calls.txt), the record named "def456"; returns its environment once the GPU is free."""
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name, text in (("python3", STUB_PYTHON), ("nvidia-smi", "#!/usr/bin/env bash\necho 'NVIDIA H100, 1980 MHz'\n")):
        (stubs / name).write_text(text)
        (stubs / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{stubs}:{os.environ['PATH']}",
        "STUB_LOG": str(tmp_path / "calls.txt"),
        "CHECK_DIR": str(tmp_path / "copy"),
        "GPU_FREE_FLAG": str(tmp_path / "free"),
        "DETACH": "1",
        "VERIFY_COMMIT": "def456",
        "OUT": str(tmp_path / "out"),
        **settings,
    }
    started = subprocess.run([*SCRIPT, patches, "abc123"], cwd=REPO, env=env, capture_output=True, text=True)
    assert started.returncode == 0 and "runs detached" in started.stdout, started.stdout + started.stderr
    for _ in range(600):
        if (tmp_path / "free").exists():
            break
        time.sleep(0.1)
    assert (tmp_path / "free").exists(), (tmp_path / "copy-out" / "log.txt").read_text()
    return env


@pytest.mark.skipif(not standalone() or shutil.which("git") is None, reason="needs a parked patch, and git to apply it")
def test_the_device_script_runs_detached_beside_the_lanes_and_frees_the_gpu(tmp_path: Path) -> None:
    """DETACH=1 (device run 25's way): the steps run in a copy of the tree, so the next device call may replace the
    tree; gpu_verify names the commit the patch will land as; the flag the lanes wait for is touched at the end."""
    env = run_detached(tmp_path, standalone()[0].name, CHECK_GPU="3")
    calls = (tmp_path / "calls.txt").read_text()
    assert "GIT_COMMIT=abc123 GPU=3 -m benchmarks.kernels.speed" in calls
    assert f"GIT_COMMIT=abc123+{standalone()[0].stem} GPU=3 -m benchmarks.kernels.speed" in calls
    assert "GIT_COMMIT=def456 GPU=3 -m benchmarks.kernels.gpu_verify" in calls and "-m pytest" not in calls
    # The patch went into the copy, not into this tree.
    back = subprocess.run(["git", "apply", "--check", "--reverse", str(standalone()[0])], cwd=tmp_path / "copy")
    assert back.returncode == 0
    assert subprocess.run(["git", "apply", "--check", str(standalone()[0])], cwd=REPO).returncode == 0
    collected = subprocess.run([*SCRIPT, "collect"], cwd=REPO, env=env, capture_output=True, text=True)
    assert collected.returncode == 0 and collected.stdout.rstrip().endswith("done"), collected.stdout
    assert {p.name for p in (tmp_path / "out" / "check").iterdir()} >= {"log.txt", "after.json", "gpu-verified.json"}


@pytest.mark.skipif(len(standalone()) < 2 or shutil.which("git") is None, reason="needs two parked patches, and git")
def test_the_device_script_applies_several_patches_in_order_for_one_record(tmp_path: Path) -> None:
    """Patches that land together get one record (device run 30): a comma-separated list, applied in order in the
    copy; SPEED=0 times nothing, and gpu_verify names the commit they will land as."""
    env = run_detached(tmp_path, f"{standalone()[0].name},{standalone()[1].name}", SPEED="0")
    calls = (tmp_path / "calls.txt").read_text()
    assert (
        "-m benchmarks.kernels.speed" not in calls
        and "GIT_COMMIT=def456 GPU=0 -m benchmarks.kernels.gpu_verify" in calls
    )
    for patch in standalone()[:2]:  # both went into the copy
        back = subprocess.run(["git", "apply", "--check", "--reverse", str(patch)], cwd=tmp_path / "copy")
        assert back.returncode == 0, patch.name
    (tmp_path / "bad").mkdir()
    in_copy = ["bash", str(tmp_path / "copy" / "benchmarks" / "pending" / "check_patch.sh")]  # it works in the copy
    bad = subprocess.run(
        [*in_copy, f"{standalone()[0].name},no-such.patch", "abc123"],
        cwd=tmp_path / "copy",
        env={**env, "DETACH": "0", "OUT": str(tmp_path / "bad")},
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 3, (tmp_path / "bad" / "log.txt").read_text()  # the first is applied already: it fails


def test_a_stacked_patch_applies_after_the_patches_it_names(tmp_path: Path) -> None:
    """A patch written on top of other parked patches (the dK/dV merge on the D=64 patch) names them in its header."""
    first = tmp_path / "pending" / "first.patch"
    first.parent.mkdir()
    first.write_text(
        "diff --git a/notes/a.txt b/notes/a.txt\nnew file mode 100644\n--- /dev/null\n+++ b/notes/a.txt\n"
        "@@ -0,0 +1 @@\n+one\n"
    )
    body = "diff --git a/notes/a.txt b/notes/a.txt\n--- a/notes/a.txt\n+++ b/notes/a.txt\n@@ -1 +1 @@\n-one\n+two\n"
    stacked, alone = tmp_path / "pending" / "second.patch", tmp_path / "pending" / "alone.patch"
    stacked.write_text("Applies after: first.patch\n\n" + body)
    alone.write_text(body)
    assert prerequisites(stacked) == [first] and prerequisites(alone) == []
    done, files = applied_copy(stacked, tmp_path / "a")
    assert done.returncode == 0 and files == ["notes/a.txt"], done.stderr
    assert (tmp_path / "a" / "notes" / "a.txt").read_text() == "two\n"
    assert applied_copy(alone, tmp_path / "b", check_only=True)[0].returncode != 0
