"""bench_emulator.py flow with the fleet's capacity measured at the engines' own limit, so that
router settings that keep a reserve under the engines' `max_num_seqs` are offered the same
load.

    python bench/emulator_flow_capped.py --engine-max-num-seqs 8 [bench_emulator.py flow's flags]

bench_emulator.py flow measures the capacity with engines x `--capacity` streams (the router's
`max_in_flight_per_engine` less the reserve), and offers `--load` x that. With a reserve kept
under the engines' `--engine-max-num-seqs` (`--capacity 6 --reserve 2` at 8: the router sends
an engine at most 8, the lower bands at most 6), that measures less than the fleet serves and
offers less load. This runs the same bench with the capacity measured at engines x
`--engine-max-num-seqs` streams instead, everything else as bench_emulator.py flow does it
(same flags, same output).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import replace

import trio

import bench_emulator
import bench_flow
import emulator_flow


def main(argv: Sequence[str] | None = None) -> int:
    args = bench_emulator.parse_args(["flow", *(sys.argv[1:] if argv is None else argv)])
    if not args.engine_max_num_seqs:
        raise SystemExit("--engine-max-num-seqs is required: the capacity is measured at it")
    measure = emulator_flow.calibrate

    async def calibrate(
        urls: Sequence[str], workload: bench_flow.Workload, seconds: float
    ) -> float:
        return await measure(urls, replace(workload, capacity=args.engine_max_num_seqs), seconds)

    emulator_flow.calibrate = calibrate  # emulator_flow.bench_flow calls it by its name
    result = trio.run(emulator_flow.bench_flow, args)
    print(json.dumps(result, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
