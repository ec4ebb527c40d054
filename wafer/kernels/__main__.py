"""`python -m wafer.kernels`: build every kernel variant this CPU runs (build.main)."""

import sys

from wafer.kernels.build import main

sys.exit(main())
