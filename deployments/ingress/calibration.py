"""k "auto"'s cost profile for the served topology, measured on this node before any request.

The ingress's prober runs `calibrate_served` once every part answers, so the service says
"loading" until the profile is in: the timings go through the same remote parts a round uses
(fly_serve/k_auto/cost_calibration.py), and the cache key names the topology, so a TP = 2 target and a
TP = 1 target, or a drafter in its own replica and one in the ingress, each get their own entry.
A profile given in the app's args overrides it; a failed measurement leaves the default cost shape
(which the policy's cost check corrects from the first rounds) rather than a service that never
becomes ready."""

import logging

from deployments.profiles.app_args import AppArgs
from fly_serve.engine.engine import Engine
from fly_serve.k_auto.cost_calibration import calibrate_engine, calibration_key

log = logging.getLogger("ray.serve")


def calibrate_served(engine: Engine, args: AppArgs) -> None:
    config = args.engine_config()
    if config.speculation_profile is not None or not engine.defaults.auto_k:
        return
    key = calibration_key(
        config,
        engine.defaults.k_max,
        tp_size=args.tp_size,
        target_threads=args.target_threads,
        drafter_threads=args.drafter_threads,
        drafter_placement=args.drafter_placement,
        # named only when in the ingress: the caches of the replica shapes stay valid
        **({"target_placement": "ingress"} if args.target_placement == "ingress" else {}),
    )
    try:
        calibrate_engine(engine, key, progress=lambda line: log.info("fly: %s", line))
    except Exception:
        log.warning("fly: calibration failed; k auto starts from the default cost shape", exc_info=True)
