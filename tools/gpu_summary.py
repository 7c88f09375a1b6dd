"""Print a short table from a pytest JUnit XML file: test, outcome, seconds, recorded figures.

Usage: python tools/gpu_summary.py results.xml
"""

import sys
import xml.etree.ElementTree as ET


def main(path: str) -> None:
    rows = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if case.find(tag) is not None:
                outcome = {"failure": "FAILED", "error": "ERROR", "skipped": "skipped"}[tag]
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        figures = ", ".join(f"{k}={v}" for k, v in props.items())
        rows.append((case.get("name"), outcome, float(case.get("time", 0)), figures))
    width = max((len(r[0]) for r in rows), default=4)
    print(f"{'test':<{width}}  {'outcome':<8} {'sec':>7}  figures")
    for name, outcome, secs, figures in rows:
        print(f"{name:<{width}}  {outcome:<8} {secs:7.1f}  {figures}")


if __name__ == "__main__":
    main(sys.argv[1])
