"""Runs that drive a live fly-serve app from outside, over HTTP and its processes: load
(load_sweep.py, locustfile.py), a long soak (soak.py) and the fault scenarios (scenarios.py,
fuzz.py; fault_run.py runs them all and prints their results, tests/test_faults.py asserts on
them). The mechanics they share: client.py (requests that end in an Outcome), procs.py (the app's
processes), waits.py (the one wait loop), server.py (`fly-serve serve` as a child).

Layering: imports fly_serve and fly_bench.prompts; nothing below imports it (tests do)."""
