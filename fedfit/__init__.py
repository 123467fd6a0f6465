"""FedFit: federated learning across unequal edge devices over MQTT.

This package is the top layer: the ``fedfit`` command and the broker-based local simulator (``fedfit.sim``).
The wire contract is ``protocol``, the models ``models``, shared plumbing ``common``; the method-specific code
lives in ``coordinator`` (server half) and ``edge_agent`` (client half).
"""

__version__ = "0.1.0"
