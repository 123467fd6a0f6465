"""FedFit: federated learning across unequal edge devices over MQTT.

This package holds what the daemons share beyond the wire contract (logging, the MQTT link, systemd
notification, configuration, data) and the ``fedfit`` command with its broker-based local simulator.
The method-specific code lives in ``coordinator`` (server half) and ``edge_agent`` (client half).
"""

__version__ = "0.1.0"
