"""The ceilings of any tuner in a space, from exhaustive sweeps: the command line of
:mod:`flashtune.report.headroom` (``python -m flashtune.report.headroom`` is the same).

    python benchmarks/headroom.py benchmarks/results/explore_fwd_occupancy_d128_h100.json \
        benchmarks/results/explore_fwd_occupancy_d64_h100.json \
        --fix MAXNREG=0,PERSISTENT=0 --tuned benchmarks/results/tune_grid_h100.json
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flashtune.report.headroom import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
