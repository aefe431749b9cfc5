"""What one line appended to a run file costs as the file grows (flopwise.files.rundir.append).

    python benchmarks/throughput/append_cost.py            # ms per append at 100 ... 20,000 lines, and the ratio

Every metrics line and console log line of a run is such an append: its new size and sha256 go into
the run record first. If the check that the file still holds what flopwise wrote re-reads it, the cost
grows with the file, and a long run that logs every step slows as it goes. The ratio of the last
figure to the first says whether it does (about 1 when it does not).
"""

import tempfile
import time
from pathlib import Path

from flopwise.files import rundir

LINE = b'{"step": 12345, "loss": 3.14159, "lr": 0.001, "tokens_per_s": 4500.0, "time_s": 0.0234}\n'
AT = (100, 1000, 5000, 10000, 20000)


def main(timed: int = 200) -> None:
    with tempfile.TemporaryDirectory() as d:
        run = rundir.claim(Path(d) / "run", ["metrics.jsonl"])
        ms = {}
        for i in range(1, AT[-1] + 1):
            rundir.append(run, "metrics.jsonl", LINE)
            if i in AT:
                t0 = time.perf_counter()
                for _ in range(timed):
                    rundir.append(run, "metrics.jsonl", LINE)
                ms[i] = (time.perf_counter() - t0) / timed * 1e3
                kib = (run / "metrics.jsonl").stat().st_size >> 10
                print(f"{i:>6} lines ({kib:>5} KiB): {ms[i]:.2f} ms per append")
        print(f"ratio {AT[-1]} lines / {AT[0]} lines: {ms[AT[-1]] / ms[AT[0]]:.2f}")


if __name__ == "__main__":
    main()
