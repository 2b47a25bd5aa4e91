"""The remote parts: the target replica (tensor-parallel ranks), the drafter replica, the clients
that let the ingress's engine call them as its Scorer and Drafter, and the row wire protocol."""
