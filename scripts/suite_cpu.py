"""The suite's cost in CPU seconds, from FLOPWISE_TEST_CPU's lines (tests/conftest.py): the total and
the files that cost most. CI prints it after the tests, so a change that makes the suite dearer shows."""

import json
import sys
from collections import Counter


def main(path: str, top: int = 8) -> None:
    rows = [json.loads(line) for line in open(path) if line.strip()]
    by_file: Counter[str] = Counter()
    for r in rows:
        by_file[r["test"].split("::")[0]] += r["cpu"]
    total = sum(by_file.values())
    print(f"== the suite's CPU seconds: {total:,.0f} over {len(rows)} tests")
    for name, cpu in by_file.most_common(top):
        print(f"   {cpu:8,.0f}  {name}")


if __name__ == "__main__":
    main(sys.argv[1])
