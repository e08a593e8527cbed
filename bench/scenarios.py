"""The long real-process scenarios, kept out of the README's test command (pytest -m scenario).

Each has a faster representative in the suite (named where it is marked); here they run whole, as
tests, and their outcome and time go to bench/results/scenarios.json.

    python bench/scenarios.py
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "scenarios.json"


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="scenarios-") as folder:
        report = Path(folder) / "junit.xml"
        code = subprocess.call(
            [sys.executable, "-m", "pytest", "-q", "-m", "scenario", f"--junitxml={report}"], cwd=ROOT
        )
        cases = ET.parse(report).getroot().iter("testcase")
        outcomes = {
            f"{case.get('classname')}::{case.get('name')}": {
                "seconds": round(float(case.get("time", 0)), 1),
                "outcome": next(
                    (child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed"
                ),
            }
            for case in cases
        }
    RESULTS.write_text(
        json.dumps({"when": time.strftime("%Y-%m-%d"), "machine": platform.machine(), "tests": outcomes}, indent=1)
        + "\n"
    )
    print(json.dumps(outcomes, indent=1))
    return code


if __name__ == "__main__":
    sys.exit(main())
