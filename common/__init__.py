"""Plumbing the daemons share beyond the wire contract: the MQTT link and broker settings, structured logs,
systemd notification, validated YAML configuration, datasets with their federated partitions, and child processes
that end with the process that started them.

A bottom layer: it imports neither daemon nor the ``fedfit`` command.
"""
