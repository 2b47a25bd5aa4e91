"""Which replica gets a call: drafter groups by prefix affinity (PinnedRouter, BusyPolicy for the
pool's autoscaling) and the HTTP proxy's choice of an ingress unit."""
