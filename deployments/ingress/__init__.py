"""The FlyIngress deployment: routes (ingress.py), the engine's round loop in a background thread
(engine_loop.py), health and readiness, tokenization, streaming, metrics and the served calibration."""
