"""The demo's core, shortened: fake partner + policy + calls + dispenser + worker on the embedded default."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from support.processes import ROOT


@pytest.mark.embedded
@pytest.mark.slow
def test_quick_demo_finishes_every_call_within_the_partners_limit(tmp_path):
    report = tmp_path / "demo.json"
    run = subprocess.run(
        [sys.executable, "-m", "demo.run_demo", "--quick", "--json", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    print(run.stdout[-3000:])
    assert report.exists(), run.stdout[-3000:] + run.stderr[-3000:]
    result = json.loads(report.read_text())
    one, two, three, bucket = result["parts"]
    assert one["statuses"] == {"done": one["sent"]}
    assert one["peak"] <= 20 and one["rejected_429"] == 0
    assert two["statuses"].get("failed", 0) == 0 and two["statuses"].get("done") == two["sent"]
    assert two["rejected_429"] > 0
    assert three["statuses"] == {"done": three["sent"]} and three["rejected_429"] <= 5
    # The bucket-shaped API: its burst at once, then its steady rate, and not one 429.
    assert bucket["statuses"] == {"done": bucket["sent"]} and bucket["rejected_429"] == 0
    assert result["passed"] and run.returncode == 0
