"""A secured Mosquitto for a fleet: TLS, one login per device and one for the coordinator, and an ACL that pins
every device to its own topics (``fedfit broker init`` and ``fedfit broker add-device``)."""

from fedfit.secure_broker.directory import DEFAULT_PORT, BrokerDirectory, BrokerSettings, BrokerSetupError
from fedfit.secure_broker.pki import PkiError

__all__ = ["DEFAULT_PORT", "BrokerDirectory", "BrokerSettings", "BrokerSetupError", "PkiError"]
