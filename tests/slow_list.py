"""Which tests `make test-fast` leaves out: those marked `slow` in their file, and those listed
in tests/slow_tests.txt, the tests measured to take more than THRESHOLD seconds (most start
train.py runs or gloo processes). Regenerate the list from a full run's JUnit report:

    python -m pytest -n 2 --dist loadfile --junitxml=/tmp/all.xml
    python -m tests.slow_list /tmp/all.xml > tests/slow_tests.txt

A test missing from the list still runs in `make test-fast`, only slower; `make test` runs
every test either way.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

#: Seconds (measured with 2 jobs on 2 cores) above which a test counts as slow.
THRESHOLD = 3.0
LIST = Path(__file__).with_name("slow_tests.txt")


def listed() -> dict[str, float]:
    """The node ids in tests/slow_tests.txt and the seconds each was measured to take."""
    if not LIST.exists():
        return {}
    out = {}
    for line in LIST.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            node, _, seconds = line.partition("  # ")
            out[node.strip()] = float(seconds.split()[0]) if seconds else THRESHOLD
    return out


def slow_ids(junit: Path, threshold: float = THRESHOLD) -> list[tuple[str, float]]:
    """(node id, seconds) of the report's tests that took longer than `threshold`."""
    ids = []
    for case in ET.parse(junit).iter("testcase"):
        seconds = float(case.get("time", 0))
        if seconds > threshold and case.find("skipped") is None:
            path = case.get("classname", "").replace(".", "/") + ".py"
            ids.append((f"{path}::{case.get('name')}", seconds))
    return sorted(ids)


if __name__ == "__main__":
    print(f"# tests measured over {THRESHOLD:g} s (tests/slow_list.py); make test-fast skips them")
    print("\n".join(f"{node}  # {seconds:.1f} s" for node, seconds in slow_ids(Path(sys.argv[1]))))
