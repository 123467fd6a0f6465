"""Secure aggregation for masked sub-models (SecAgg, Bonawitz et al. 2017; SecAgg+, Bell et al. 2020): the pieces
both daemons share, torch-free. `encoding` (floats to fixed point modulo 2^64), `prg` (masks expanded from a seed
with AES-256-CTR, indexed by the global model's coordinates), `shamir` (t-out-of-n secret sharing), `keys`
(X25519 key agreement, shares sealed to a neighbour with ChaCha20-Poly1305), `masking` (a device's masked slice,
and the coordinator's sum of them unmasked with the seeds of the devices that dropped out)."""
