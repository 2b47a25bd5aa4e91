"""Ray Serve deployments of the fly-serve engine: ingress (API + round loop), target (tensor
parallel), draft model and prompt lookup. `deployments.app:build` builds the application."""
