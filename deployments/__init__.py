"""Ray Serve deployments of the fly-serve engine, by part: http/ (OpenAI API, errors, admission),
ingress/ (routes and the round loop), parts/ (target and drafter replicas), routing/, profiles/
(the YAML configs and AppArgs). `deployments.app:build` builds the application."""
