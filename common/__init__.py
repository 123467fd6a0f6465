"""Plumbing the daemons share beyond the wire contract: the MQTT link and broker settings, structured logs,
systemd notification, validated YAML configuration, and datasets with their federated partitions.

A bottom layer: it imports neither daemon nor the ``fedfit`` command.
"""
