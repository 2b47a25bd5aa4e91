"""Prompt lookup as its own deployment: no model, a fraction of a CPU, any replica can serve
any row (rows carry all their tokens). Used for `pld` mode when the app is built with
pld="deployment"; by default the ingress runs prompt lookup in-process (deployments/README.md)."""

from ray import serve

from fly_serve.contracts import Drafts, Row
from fly_serve.drafters import LookupDrafter


@serve.deployment(name="FlyPLD", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=16)
class LookupDeployment:
    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.drafter = LookupDrafter(max_n, min_n)

    def propose(self, rows: list[Row]) -> Drafts:
        return self.drafter.propose(rows)
