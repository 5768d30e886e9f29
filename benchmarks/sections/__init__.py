"""The single-GPU report's sections, one module each; each has ``run(rig, quick)``
returning its Markdown (or ``(markdown, raw rows)``).  ``python -m benchmarks.report``
runs them."""
