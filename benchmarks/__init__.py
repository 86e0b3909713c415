"""The benchmarks beside the library: ``python -m benchmarks.bench`` (a package) and the
scripts ``guard_cost.py``, ``gpu.sh``, ``gpu_check.sh`` and ``gpu_wheels.sh`` (see README.md).
Not shipped with ``ckptlib``: run them from the repository root."""
