"""Profiles: the Serve configs (*.yaml) an operator deploys, the app args they carry (AppArgs, the
one config handed to every deployment) and where their replicas go (placement)."""
