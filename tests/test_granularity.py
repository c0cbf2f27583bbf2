"""benchmarks/granularity.py: finer INT8 blocks for the backward products, measured one product at a time."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import granularity  # noqa: E402  (benchmarks/ is not a package)


def test_finer_blocks_lower_the_product_error_and_the_file_follows_the_format(tmp_path: Path) -> None:
    out = tmp_path / "g.json"
    result = granularity.main(["--seq", "256", "--head-dim", "32", "--out", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert result["kind"] == "accuracy" and result["device"] == "cpu" and result["commit"]
    rows = {(r["inputs"], r["setting"]): r for r in result["rows"]}
    sigma1 = "normal sigma=1"
    # a scale per query row (dQ) or key column (dK, dV) never does worse than one per tile
    for product, finer in (("dq", "dS per query row"), ("dk", "dS per key column"), ("dv", "P per key column")):
        tile = "P per tile" if product == "dv" else "dS per tile"
        assert rows[(sigma1, f"{product}: {finer}")]["rel_l2"] < rows[(sigma1, f"{product}: {tile}")]["rel_l2"]
    assert rows[(sigma1, "dq: dS per query row")]["rel_l2"] < 0.5 * rows[(sigma1, "dq: dS per tile")]["rel_l2"]
    # Half the tile's queries: dS's error between the tile's and the row's; P's per key column no worse.
    for product in ("dq", "dk"):
        half = rows[(sigma1, f"{product}: dS per 64 x 64 tile")]["rel_l2"]
        assert half <= rows[(sigma1, f"{product}: dS per tile")]["rel_l2"]
    half = rows[(sigma1, "dv: P per key column of 64 queries")]["rel_l2"]
    assert half <= rows[(sigma1, "dv: P per key column")]["rel_l2"] * 1.05
