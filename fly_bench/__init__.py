"""`fly-serve bench`: speed and accuracy of every decoding method, and of the peers a user would
pick instead, on real datasets, in one run (datasets.py -> methods.py -> store.py -> metrics.py ->
report.py, driven by run.py). Layering: fly_bench imports fly_serve; fly_serve never imports it."""
