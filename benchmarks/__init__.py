"""l2prefetch's benchmarks: run each as a module from the repository root, e.g.
``python -m benchmarks.report``.  See benchmarks/README.md for what each measures."""
