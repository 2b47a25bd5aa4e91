"""Prompt-lookup drafter as its own deployment: no model, a fraction of a CPU, any replica can
serve any row (rows carry all their tokens). Used for `pld` mode when the app is built with
pld="deployment"; by default the ingress calls PLDDrafter in-process (see README, "PLD")."""
from ray import serve

from fly_serve.drafters import PLDDrafter


@serve.deployment(name="FlyPLD", ray_actor_options={"num_cpus": 0.1}, max_ongoing_requests=16)
class PLDDeployment:
    def __init__(self, max_n: int = 4, min_n: int = 1):
        self.drafter = PLDDrafter(max_n, min_n)

    def propose(self, rows):
        return self.drafter.propose(rows)

    def release(self, keys):
        self.drafter.release(keys)
