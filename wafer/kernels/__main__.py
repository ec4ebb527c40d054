"""`python -m wafer.kernels`: build every kernel variant this CPU runs (build.main); with `--tune`, then
time the active variant on the installed models' shapes and keep the fastest settings (tuner.py)."""

import argparse
import logging
import sys

from wafer.kernels.build import main

ap = argparse.ArgumentParser(prog="python -m wafer.kernels", description=__doc__)
ap.add_argument("--tune", action="store_true", help="after building, tune the active variant for this machine")
args = ap.parse_args()
code = main()
if code == 0 and args.tune:
    from wafer.kernels.tuner import tune_installed

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    tune_installed()
sys.exit(code)
