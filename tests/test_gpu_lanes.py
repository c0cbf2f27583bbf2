"""benchmarks/gpu_lanes.sh on the CPU: queues of commands, one per "GPU", run detached from an installed copy of the
tree, followed and collected into $OUT as the device tool brings it back."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "gpu_lanes.sh"


def lanes(tmp_path: Path, mode: str, *args: str, follow: int = 240) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "WORK": str(tmp_path / "work"),
        "PYTHON": sys.executable,
        "CORPUS_MAX_MB": "1",
        "FOLLOW_SECONDS": str(follow),
    }
    return subprocess.run(
        ["bash", str(SCRIPT), mode, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )


def test_each_gpu_runs_its_queue_in_order_from_the_installed_copy(tmp_path: Path) -> None:
    queue = tmp_path / "run.lanes"
    queue.write_text(
        "# a comment, and a line of too few fields, are skipped\n"
        "0 short\n"
        '0 where "$PYTHON" -c "import sage_lightning.kernels as k, benchmarks as b; print(k.__file__, b.__file__)"\n'
        '1 gpu echo "gpu $CUDA_VISIBLE_DEVICES; corpus $(wc -c < "$CORPUS") bytes" > "$RESULTS/gpu1.md"\n'
        "1 fails false\n"
        "0 after echo second in its queue\n"
        '1.1 beside echo "beside on gpu $CUDA_VISIBLE_DEVICES" > "$RESULTS/beside.md"\n'
    )
    done = lanes(tmp_path, "start", str(queue))
    assert done.returncode == 0, done.stderr
    assert "finished" in done.stdout, done.stdout + done.stderr
    work, out = tmp_path / "work", tmp_path / "out"
    where = (work / "results" / "log-where.txt").read_text().split()
    assert where == [f"{work}/site/sage_lightning/kernels/__init__.py", f"{work}/src/benchmarks/__init__.py"]
    assert (work / "results" / "gpu1.md").read_text().startswith("gpu 1; corpus ")
    assert (work / "results" / "beside.md").read_text() == "beside on gpu 1\n"  # queue 1.1: a second queue on GPU 1
    log = (work / "lanes.log").read_text()
    assert "gpu 1: fails finished" in log and "exit status 1" in log.split("gpu 1: fails finished")[1].splitlines()[0]
    assert log.index("gpu 0: where finished") < log.index("gpu 0: after started")
    assert "short" not in log
    with tarfile.open(out / "lanes.tar.gz") as archive:
        names = archive.getnames()
    assert {"results/log-where.txt", "results/gpu1.md", "lanes", "lanes.log"} <= set(names)
    assert "gpu 1; corpus " in (out / "lanes-summary.md").read_text()
    again = lanes(tmp_path, "wait")
    assert again.returncode == 0 and "finished" in again.stdout


def test_a_bad_call_is_refused_with_what_works(tmp_path: Path) -> None:
    missing = lanes(tmp_path, "start", str(tmp_path / "nothing.lanes"))
    assert missing.returncode == 2 and "give a lanes file; received" in missing.stderr
    wrong = lanes(tmp_path, "go")
    assert wrong.returncode == 2 and "the mode must be start or wait; received 'go'" in wrong.stderr
    nothing = lanes(tmp_path, "wait")
    assert nothing.returncode == 1 and "no lanes here" in nothing.stdout
