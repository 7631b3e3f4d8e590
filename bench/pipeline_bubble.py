"""Pipeline bubble fraction and peak in-flight micro-batches, counted from each schedule's own timeline.

    python bench/pipeline_bubble.py

Every rank's timeline (the exact action list the executor runs) is replayed with a micro-batch's forward
through one rank's share of the model costing 1 and its backward 2, communication free; idle slots divided
by busy slots is the bubble fraction, compared with the analytic (p - 1)/m and (1/v)(p - 1)/m. On two
shared CPU cores wall time cannot show bubbles, so this is the measurement (DESIGN.md, Testing).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megazero.pipeline.schedules import simulate  # noqa: E402


def main() -> None:
    print("| schedule | p | v | m | bubble (timeline) | analytic | peak in-flight micro-batches (stage 0 .. p-1) |")
    print("|---|---|---|---|---|---|---|")
    for name, v in (("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("interleaved", 4)):
        for p in (2, 4, 8):
            for m in (p, 2 * p, 4 * p):
                r = simulate(name, p, m, v)
                peak = " ".join(f"{x:g}" for x in r.peak_in_flight)
                print(f"| {name} | {p} | {v} | {m} | {r.bubble_fraction:.4f} | {(p - 1) / m / v:.4f} | {peak} |")


if __name__ == "__main__":
    main()
