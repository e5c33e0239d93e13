"""Where a test run's time goes: reads the log of `python -m pytest --durations=0` and prints the
slowest tests (setup, call and teardown added up) and the time per folder, as docs/perf.md lists
them.

    python -m pytest --durations=0 2>&1 | tee suite.log
    python -m benchmarks.suite_durations suite.log
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

# one line of pytest's durations table: "12.34s call     tests/engine/test_x.py::test_y[a]"
DURATION_LINE = re.compile(r"^\s*(\d+(?:\.\d+)?)s\s+(setup|call|teardown)\s+(\S.*?)\s*$")
SUMMARY_LINE = re.compile(r"=+ (.*\b(?:passed|failed)\b.*) in ([\d.]+)s")


def read_durations(lines: list[str]) -> dict[str, float]:
    """Seconds per test id, its setup, call and teardown added up."""
    per_test: dict[str, float] = defaultdict(float)
    for line in lines:
        match = DURATION_LINE.match(line)
        if match:
            per_test[match.group(3)] += float(match.group(1))
    return dict(per_test)


def folder_of(test_id: str) -> str:
    path = test_id.split("::")[0]
    return path.rsplit("/", 1)[0] if "/" in path else path


def report(lines: list[str], num_slowest: int = 30) -> str:
    per_test = read_durations(lines)
    per_folder: dict[str, float] = defaultdict(float)
    for test_id, seconds in per_test.items():
        per_folder[folder_of(test_id)] += seconds
    out = [f"| seconds | the {num_slowest} slowest tests (setup + call + teardown) |",
           "|---:|---|"]
    slowest = sorted(per_test.items(), key=lambda item: -item[1])[:num_slowest]
    out += [f"| {seconds:.1f} | `{test_id}` |" for test_id, seconds in slowest]
    out += ["", "| folder | seconds | share |", "|---|---:|---:|"]
    total = sum(per_folder.values()) or 1.0
    for folder, seconds in sorted(per_folder.items(), key=lambda item: -item[1]):
        out.append(f"| `{folder}` | {seconds:.0f} | {100 * seconds / total:.0f}% |")
    out.append(f"| all tests | {total:.0f} | |")
    summary = [m for m in map(SUMMARY_LINE.search, lines) if m]
    if summary:
        out.append(f"\npytest: {summary[-1].group(1)} in {float(summary[-1].group(2)):.0f} s "
                   f"(wall clock, collection included)")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log", help="the output of a pytest run with --durations=0")
    parser.add_argument("--slowest", type=int, default=30)
    args = parser.parse_args()
    with open(args.log, encoding="utf-8", errors="replace") as f:
        print(report(f.read().splitlines(), args.slowest))


if __name__ == "__main__":
    main()
