"""The benchmarks beside the library: ``python -m benchmarks.bench`` (a package) and the
scripts ``region_cost.py``, ``hf_models.py``, ``gpu.sh``, ``gpu_check.sh`` and ``gpu_wheels.sh``
(see README.md).
Not shipped with ``ckptlib``: run them from the repository root."""
