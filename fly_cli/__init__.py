"""The `fly-serve` command line: it sits above the engine (fly_serve) and the Serve app
(deployments), so it may import both."""
