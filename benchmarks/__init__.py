"""Side-by-side benchmarks of accelkit against Hugging Face accelerate and the machine's limits.

Run everything with ``python -m benchmarks [--quick]``; see ``benchmarks/README.md``. These are
measurements, not tests: they write ``benchmarks/results/<name>.json`` and the README table is
generated from those files by ``python -m benchmarks.report``.
"""
