"""wafer's CPU kernels: the C++ sources (csrc/) and their build, one compiled extension per
instruction-set variant (build.py). `python -m wafer.kernels` builds every variant this CPU runs."""
