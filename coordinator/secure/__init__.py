"""Secure aggregation (SecAgg+ over masked sub-models; docs/privacy.md): the coordinator learns each coordinate's
sum over the devices that hold it, never one device's update. `room.SecureRounds` is the daemon's room."""
