"""Load test, EDF vs FIFO: see kvengine/bench/load.py (also `kvengine bench load`)."""
import os
import sys

from kvengine.bench.load import main

if __name__ == "__main__":
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "load")
    sys.exit(main(sys.argv[1:] if "--out" in sys.argv else sys.argv[1:] + ["--out", out]))
