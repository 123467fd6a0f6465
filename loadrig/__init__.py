"""The load-test rig: synthetic fleets, the load mode, a 3-node RabbitMQ cluster and a raw MQTT client, for
``benchmarks/`` and the tests. It is not part of the simulator and does not ship with it: the ``fedfit`` package
never imports it, and the installed distribution does not include it (run it from a checkout's root).

- :mod:`loadrig.load`: the load mode, one real coordinator driven by SYNTHETIC agents (no training) through real
  brokers (``benchmarks/fleet_load.py``, ``benchmarks/broker_cluster.py``);
- :mod:`loadrig.agents`: a worker process of many synthetic agents on one event loop (``python -m loadrig.agents``);
- :mod:`loadrig.synthetic`: the synthetic updates they answer with;
- :mod:`loadrig.coordinator_process`: the load run's coordinator in a process of its own
  (``python -m loadrig.coordinator_process``), profiled by :mod:`loadrig.sampler`;
- :mod:`loadrig.rabbitmq`: a RabbitMQ cluster on loopback, secured or not;
- :mod:`loadrig.raw_client`: a bare MQTT 5 client for playing strangers and thieves against a broker.

Layers: the rig sits on top of ``fedfit`` and may import it and everything below; nothing imports the rig.
"""
