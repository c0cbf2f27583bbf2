"""Screenshots of a run's TensorBoard: what it opens on (Time Series, the sage group first), the sage/ dashboard
(Custom Scalars), the decisions (Text), the precision picture (Images) and the run's settings (HParams).

Starts a real ``tensorboard --logdir`` on localhost, waits until it has loaded the runs, points headless Chromium
at it, saves the PNGs and stops the server. This is how docs/example.md's pictures were made; run it again after
``make demo`` to redo them:

    python examples/screenshot_tensorboard.py --logdir runs/tiny --out-dir docs/images

Needs Chromium (Debian: ``apt-get install chromium``); ``--chromium`` names another binary.
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

#: (file name, page, window width, window height). Custom Scalars with smoothing off, so each level change shows
#: where it happened; Time Series as TensorBoard first shows it, but drawn in SVG (its WebGL charts are drawn off
#: the page's clock and came out empty in about half the shots); HParams wide enough for its metric columns.
PAGES: tuple[tuple[str, str, int, int], ...] = (
    ("tensorboard-time-series.png", "?forceSVG=true#timeseries", 1400, 900),
    ("tensorboard-sage-dashboard.png", "#custom_scalars&_smoothingWeight=0", 1400, 2250),
    ("tensorboard-sage-decisions.png", "#text", 1400, 760),
    ("tensorboard-sage-precision.png", "#images", 1400, 760),
    ("tensorboard-hparams.png", "#hparams", 1900, 520),
)


def free_port() -> int:
    """A TCP port nothing listens on, on the loopback interface."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_runs(url: str, timeout_s: float = 60.0) -> list[str]:
    """Poll TensorBoard until it lists at least one run; return the runs.

    Raises:
        TimeoutError: no run after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/data/runs", timeout=5) as response:
                runs = json.loads(response.read())
            if runs:
                return runs
        except (urllib.error.URLError, ConnectionError, json.JSONDecodeError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"TensorBoard at {url} listed no run within {timeout_s:.0f} s.")


def find_chromium(given: str | None) -> str:
    """The Chromium binary: ``given``, else the first of chromium, chromium-browser, google-chrome on PATH.

    Raises:
        FileNotFoundError: none found.
    """
    for name in [given] if given else ["chromium", "chromium-browser", "google-chrome"]:
        path = shutil.which(name)
        if path:
            return path
    raise FileNotFoundError(
        f"--chromium: no browser found (tried {given or 'chromium, chromium-browser, google-chrome'}); install one "
        "(Debian: apt-get install chromium) or pass its path."
    )


def main(argv: list[str] | None = None) -> list[Path]:
    """Take the screenshots; return their paths.

    Example::

        main(["--logdir", "runs/tiny", "--out-dir", "/tmp/shots"])
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--logdir", type=Path, default=Path("runs/tiny"))
    parser.add_argument("--out-dir", type=Path, default=Path("docs/images"))
    parser.add_argument("--chromium", default=None, help="browser binary (default: chromium on PATH)")
    args = parser.parse_args(argv)
    if not args.logdir.is_dir():
        parser.error(f"--logdir must be a folder of TensorBoard runs; received {str(args.logdir)!r} (run make demo).")
    browser = find_chromium(args.chromium)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(args.logdir),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    shots = []
    profile = tempfile.mkdtemp(prefix="chromium-profile-")
    try:
        print("runs:", ", ".join(wait_for_runs(url)))
        for name, page, width, height in PAGES:
            path = args.out_dir / name
            subprocess.run(
                [
                    browser,
                    "--headless=new",
                    "--no-sandbox",
                    "--disable-gpu",
                    "--hide-scrollbars",
                    # No calls home (this may run where only localhost answers) and a profile of its own.
                    "--disable-background-networking",
                    "--disable-component-update",
                    "--disable-sync",
                    "--no-first-run",
                    f"--user-data-dir={profile}",
                    f"--window-size={width},{height}",
                    # The dashboard loads its data after the page: let the page's clock run on before the shot.
                    "--virtual-time-budget=15000",
                    f"--screenshot={path}",
                    f"{url}/{page}",
                ],
                check=True,
                capture_output=True,
                timeout=120,
            )
            print(f"wrote {path} ({path.stat().st_size // 1024} KB)")
            shots.append(path)
    finally:
        shutil.rmtree(profile, ignore_errors=True)
        server.terminate()
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()
    return shots


if __name__ == "__main__":
    main()
