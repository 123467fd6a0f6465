"""Client-level differential privacy over masked sub-model updates (DP-FedAvg; docs/privacy.md): the ``privacy``
section (`settings`), the round's private aggregate (`aggregate`), the privacy spent (`ledger`), and the room the
coordinator makes once (`guard`: the clip bound in every task's plan, adaptive clipping, the budget). Import the
submodules (the configuration imports `settings` alone)."""
