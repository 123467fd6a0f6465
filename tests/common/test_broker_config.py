"""The ``broker`` section both daemons share: its checks, and the login it reads."""

from __future__ import annotations

import shutil
import socket
import threading
from pathlib import Path

import pytest

from common.config import from_mapping
from common.mqtt_link import BrokerConfig, BrokerUnavailable, MqttLink
from fedfit.secure_broker.pki import make_ca


def test_a_secured_section_reads_its_password_from_its_file(tmp_path: Path) -> None:
    secret = tmp_path / "pi.password"
    secret.write_text("s3cret\n")
    ca = tmp_path / "ca.crt"
    ca.write_text("-----BEGIN CERTIFICATE-----\n")
    config = from_mapping(BrokerConfig, {"host": "broker.lan", "port": 8883, "tls": True, "ca_file": str(ca),
                                         "username": "pi", "password_file": str(secret)}, where="broker")
    config.validate()
    assert config.secured and config.login() == ("pi", "s3cret")
    assert BrokerConfig(username="pi", password="inline").login() == ("pi", "inline")
    assert BrokerConfig().login() is None and not BrokerConfig().secured
    assert not BrokerConfig(tls=True).secured and not BrokerConfig(username="pi").secured


@pytest.mark.parametrize(("fields", "message"), [
    ({"port": 0}, "broker.port must be in 1..65535"),
    ({"username": "pi", "password": "a", "password_file": "/x"}, "either 'password' or 'password_file'"),
    ({"password": "a"}, "a password needs a 'username'"),
    ({"ca_file": "/x"}, "set 'tls: true'"),
    ({"keepalive": 1}, "keepalive must be at least 5 s"),
])
def test_mistakes_are_one_sentence(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        BrokerConfig(**fields).validate()  # type: ignore[arg-type]


def test_missing_files_are_named_when_connecting(tmp_path: Path) -> None:
    config = BrokerConfig(username="pi", password_file=str(tmp_path / "gone"))
    config.validate()  # the files may live only on the device: they are read when connecting
    with pytest.raises(BrokerUnavailable, match="cannot read broker.password_file .*gone"):
        config.login()
    link = MqttLink(client_id="pi", broker=BrokerConfig(tls=True, ca_file=str(tmp_path / "ca.crt")),
                    subscriptions=["x"], handler=lambda _t, _p: None)
    with pytest.raises(BrokerUnavailable, match=r"cannot use broker.ca_file '.*ca.crt' \(No such file"):
        link.start(timeout=1)
    link.stop()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="the openssl command is not installed")
def test_a_tls_handshake_cut_off_is_tried_again(tmp_path: Path) -> None:
    """A broker that closes the connection mid-handshake (restarting, say) is not a certificate problem."""
    ca_file, _ = make_ca(tmp_path, "test CA")
    server = socket.create_server(("127.0.0.1", 0))
    accepted: list[int] = []

    def close_everything() -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:
                return
            accepted.append(1)
            connection.close()

    threading.Thread(target=close_everything, daemon=True).start()
    link = MqttLink(client_id="pi", broker=BrokerConfig(host="127.0.0.1", port=server.getsockname()[1], tls=True,
                                                        ca_file=str(ca_file)),
                    subscriptions=["x"], handler=lambda _t, _p: None)
    try:
        # The cut shows as an SSL EOF, or as a reset when the close beats the client's hello: both are tried again.
        with pytest.raises(BrokerUnavailable, match=r"cannot reach the MQTT broker at .* \((the TLS handshake was "
                                                    r"cut off: |\[Errno 104\] Connection reset)"):
            link.start(timeout=3)
    finally:
        link.stop()
        server.close()
    assert len(accepted) >= 2  # tried again, not given up at the first cut
