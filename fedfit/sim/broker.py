"""A real MQTT broker on a free loopback port for local runs and tests.

Mosquitto when it is installed; otherwise amqtt, a pure-Python broker (MQTT 3.1.1 only) run in a
background thread, so that `fedfit sim` works with nothing but pip packages.

A mosquitto started here ends with the process that started it, however that ends (``common.lifeline``: a
SIGKILLed ``fedfit sim`` leaves no broker behind), and its files (configuration, log and, secured, the CA key
and the logins' passwords) live in a directory of its own, 0700: the caller's (``fedfit sim``: the run's
``broker/``), else a fresh one in the system's temporary directory; ``stop()`` removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from common.lifeline import spawn_tied
from common.mqtt_link import BrokerConfig
from fedfit.secure_broker import BrokerDirectory, BrokerSettings, BrokerSetupError, PkiError

BrokerKind = Literal["mosquitto", "amqtt", "external"]

_MOSQUITTO_CANDIDATES = ("mosquitto", "/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto")


class BrokerStartError(RuntimeError):
    """No broker could be started; the message says what to install or pass instead."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(host: str, port: int, timeout: float) -> bool:
    """Whether something accepts TCP connections on host:port within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=0.5):
            return True
        time.sleep(0.05)
    return False


def find_mosquitto() -> str | None:
    """Path of the mosquitto binary, or None."""
    for candidate in _MOSQUITTO_CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    return None


def mosquitto_version(binary: str) -> str:
    """Version string printed by ``mosquitto -h`` (e.g. "2.0.11")."""
    result = subprocess.run([binary, "-h"], capture_output=True, text=True, timeout=10, check=False)
    for word_line in (result.stdout + result.stderr).splitlines():
        if word_line.startswith("mosquitto version"):
            return word_line.split()[-1]
    return "unknown"


@dataclass
class Broker:
    """A running broker; ``stop()`` ends it (a no-op for an external one).

    A secured one (``directory`` set: TLS, logins, ACL) gives each client its own login through
    :meth:`client_config`, adding it to the running broker when it is new.
    """

    kind: BrokerKind
    version: str
    host: str
    port: int
    directory: BrokerDirectory | None = None
    _stop: Any = field(default=None, repr=False)
    _reload: Any = field(default=None, repr=False)
    _restart: Any = field(default=None, repr=False)
    _pid: Any = field(default=None, repr=False)

    @property
    def secured(self) -> bool:
        return self.directory is not None

    @property
    def pid(self) -> int | None:
        """The process id of a mosquitto started here (its latest, after a restart); None for another broker."""
        return None if self._pid is None else int(self._pid())

    def client_config(self, name: str) -> BrokerConfig:
        """The ``broker`` section for the client logging in as ``name`` (an agent id, or the coordinator's
        username); on an unsecured broker, just host and port."""
        if self.directory is None:
            return BrokerConfig(host=self.host, port=self.port)
        self.add_logins([name])
        return self.directory.client_config(name, host=self.host)

    def coordinator_config(self) -> BrokerConfig:
        """The ``broker`` section of the coordinator (its own login on a secured broker)."""
        return self.client_config(self.directory.settings.coordinator if self.directory else "coordinator")

    def add_logins(self, names: Sequence[str]) -> None:
        """Give every new name in ``names`` a login, and wait until the running broker accepts them."""
        if self.directory is None:
            return
        known = set(self.directory.logins())
        new = [name for name in dict.fromkeys(names) if name not in known]
        for name in new:
            self.directory.add_login(name)
        if new and self._reload is not None:
            self._reload()
            wait_for_login(self.directory.client_config(new[-1], host=self.host), timeout=10.0)

    def restart(self, down_s: float = 0.0, until: threading.Event | None = None) -> None:
        """Stop the broker, leave it down ``down_s`` seconds (or, with ``until``, until that is set, at most
        ``down_s``), and start it again on the same port (the clients' sessions are gone; with persistence off, so
        are retained messages). Only a mosquitto started here."""
        if self._restart is None:
            raise BrokerStartError(f"a {self.kind} broker cannot be restarted from here")
        self._restart(down_s, until)

    def stop(self) -> None:
        if self._stop is not None:
            self._stop()
            self._stop = None


def external_broker(address: str) -> Broker:
    """A broker given as HOST:PORT; raises ValueError for a malformed address."""
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise ValueError(f"--broker must be HOST:PORT (e.g. 127.0.0.1:1883), got {address!r}")
    return Broker(kind="external", version="unknown", host=host, port=int(port_text))


def _try_login(config: BrokerConfig) -> str:
    """One connection with ``config``'s login: "ok", or why the broker did not take it."""
    answered = threading.Event()
    outcome: list[str] = []

    def on_connect(client: mqtt.Client, userdata: Any, flags: Any, reason: Any, properties: Any) -> None:
        outcome.append("ok" if not reason.is_failure else str(reason))
        answered.set()

    client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=f"fedfit-login-check-{os.getpid()}",
                         protocol=mqtt.MQTTv311)
    login = config.login()
    if login is not None:
        client.username_pw_set(*login)
    if config.tls:
        client.tls_set(ca_certs=config.ca_file)
    client.on_connect = on_connect
    try:
        client.connect(config.host, config.port, keepalive=10)
        client.loop_start()
        answered.wait(2.0)
    except OSError as exc:
        outcome.append(str(exc))
    finally:
        client.disconnect()
        client.loop_stop()
    return outcome[0] if outcome else "no answer"


def wait_for_login(config: BrokerConfig, timeout: float) -> None:
    """Wait until the broker accepts ``config``'s login (after a reload that added it); BrokerStartError if not."""
    deadline = time.monotonic() + timeout
    while True:
        outcome = _try_login(config)
        if outcome == "ok":
            return
        if time.monotonic() >= deadline:
            raise BrokerStartError(f"the broker at {config} did not accept login {config.username!r} within "
                                   f"{timeout:.0f} s ({outcome})")
        time.sleep(0.05)


@dataclass
class _MosquittoProcess:
    """The mosquitto process of a broker started here (a restart replaces it), its log and its directory."""

    binary: str
    conf: Path
    port: int
    log_file: Any
    workdir: Path
    process: subprocess.Popen[bytes]

    def _terminate(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(5)

    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        self._terminate()
        self.log_file.close()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def reload(self) -> None:
        if self.process.poll() is not None:
            raise BrokerStartError(f"mosquitto on port {self.port} is not running (exit code {self.process.returncode}); "
                                   f"its log ends: {self.log_tail()}")
        self.process.send_signal(signal.SIGHUP)  # mosquitto reads its password file and ACL again

    def log_tail(self) -> str:
        """The end of mosquitto's log, for an error message."""
        self.log_file.flush()
        return (self.workdir / "mosquitto.log").read_text(errors="replace")[-500:].strip()

    def wait_running(self, since: int, timeout: float = 10.0) -> bool:
        """Wait until mosquitto's log says it runs (after byte ``since`` of the log): only then has it set up its
        signal handlers, so that a reload's SIGHUP is not taken for a request to exit."""
        path = self.workdir / "mosquitto.log"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.process.poll() is None:
            with path.open("rb") as handle:
                handle.seek(since)
                if b" running" in handle.read():
                    return True
            time.sleep(0.02)
        return False

    def restart(self, down_s: float, until: threading.Event | None = None) -> None:
        self._terminate()
        if until is not None:
            until.wait(down_s)
        else:
            time.sleep(down_s)
        since = (self.workdir / "mosquitto.log").stat().st_size
        self.process = spawn_tied([self.binary, "-c", str(self.conf)], stdout=self.log_file,
                                  stderr=subprocess.STDOUT)
        if not wait_for_port("127.0.0.1", self.port, 10.0) or not self.wait_running(since):
            raise BrokerStartError(f"mosquitto did not listen again on port {self.port} after a restart")


def _broker_dir(workdir: Path | None) -> Path:
    """The broker's own directory, made 0700: ``workdir`` (which must not exist yet), or a fresh temporary one."""
    if workdir is None:
        return Path(tempfile.mkdtemp(prefix="fedfit-mosquitto-"))  # (mkdtemp makes it 0700)
    try:
        workdir.mkdir(mode=0o700, parents=True)
        workdir.chmod(0o700)  # whatever the umask
    except OSError as exc:
        raise BrokerStartError(f"cannot make the broker's directory {workdir}: {exc.strerror or exc}") from None
    return workdir


def start_mosquitto(binary: str | None = None, attempts: int = 3, *, federation: str | None = None,
                    workdir: Path | None = None) -> Broker:
    """Start mosquitto on a free loopback port with a throw-away configuration.

    With ``federation``, the broker is secured as ``fedfit broker init`` would make it for that federation (TLS,
    no anonymous clients, one login per client, the ACL); without, anyone may connect and do anything. Its files
    go to ``workdir`` (made 0700 here; it must not exist yet), else to a fresh temporary directory; ``stop()``
    removes them. The broker is sent SIGTERM when this process ends.
    """
    binary = binary or find_mosquitto()
    if binary is None:
        raise BrokerStartError("mosquitto is not installed (apt-get install mosquitto)")
    version = mosquitto_version(binary)
    workdir = _broker_dir(workdir)
    last_output = ""
    for _ in range(attempts):
        port = free_port()
        directory: BrokerDirectory | None = None
        if federation is not None:
            shutil.rmtree(workdir / "secured", ignore_errors=True)
            try:
                directory = BrokerDirectory.init(workdir / "secured", BrokerSettings(
                    federation=federation, hosts=["127.0.0.1", "localhost"], port=port, bind="127.0.0.1",
                    persistence=False, user=pwd.getpwuid(os.geteuid()).pw_name))
            except (BrokerSetupError, PkiError) as exc:
                shutil.rmtree(workdir, ignore_errors=True)
                raise BrokerStartError(f"cannot secure the broker: {exc} (--insecure-broker runs one without TLS "
                                       f"and logins)") from None
            conf = directory.conf
        else:
            conf = workdir / "mosquitto.conf"
            conf.write_text(
                f"listener {port} 127.0.0.1\n"
                "allow_anonymous true\n"
                "persistence false\n"
                "max_queued_messages 100000\n"
                "max_inflight_messages 100\n"
            )
        log_path = workdir / "mosquitto.log"
        log_file = log_path.open("wb")
        process = spawn_tied([binary, "-c", str(conf)], stdout=log_file, stderr=subprocess.STDOUT)
        running = _MosquittoProcess(binary, conf, port, log_file, workdir, process)
        if wait_for_port("127.0.0.1", port, 10.0) and running.wait_running(0):
            return Broker(kind="mosquitto", version=version, host="127.0.0.1", port=port, directory=directory,
                          _stop=running.stop, _reload=running.reload, _restart=running.restart,
                          _pid=running.pid)
        process.kill()
        process.wait(5)
        log_file.close()
        last_output = log_path.read_text(errors="replace")[-500:]
    shutil.rmtree(workdir, ignore_errors=True)
    raise BrokerStartError(f"mosquitto did not start listening after {attempts} tries: {last_output.strip()}")


def start_amqtt(attempts: int = 3) -> Broker:
    """Start the embedded pure-Python broker (amqtt, MQTT 3.1.1) in a background thread."""
    try:
        from amqtt.broker import Broker as AmqttBroker
    except ImportError as exc:
        raise BrokerStartError("neither mosquitto nor amqtt is available: apt-get install mosquitto, or "
                               "pip install 'fedfit[embedded-broker]'") from exc
    version = metadata.version("amqtt")
    for name in ("amqtt", "transitions"):  # it logs every refused MQTT 5 probe as an error
        logging.getLogger(name).setLevel(logging.CRITICAL)
    for _ in range(attempts):
        port = free_port()
        config = {
            "listeners": {"default": {"type": "tcp", "bind": f"127.0.0.1:{port}"}},
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }
        loop = asyncio.new_event_loop()
        started = threading.Event()
        broker_box: dict[str, Any] = {}

        def serve(loop: asyncio.AbstractEventLoop = loop, config: dict[str, Any] = config,
                  started: threading.Event = started, box: dict[str, Any] = broker_box) -> None:
            asyncio.set_event_loop(loop)
            try:
                box["broker"] = AmqttBroker(config, loop=loop)
                loop.run_until_complete(box["broker"].start())
            except Exception as exc:  # noqa: BLE001 - reported to the starting thread
                box["error"] = exc
                started.set()
                return
            started.set()
            loop.run_forever()

        thread = threading.Thread(target=serve, name="amqtt-broker", daemon=True)
        thread.start()
        started.wait(15)
        if "error" not in broker_box and wait_for_port("127.0.0.1", port, 10.0):

            def stop(loop: asyncio.AbstractEventLoop = loop, box: dict[str, Any] = broker_box,
                     thread: threading.Thread = thread) -> None:
                future = asyncio.run_coroutine_threadsafe(box["broker"].shutdown(), loop)
                with contextlib.suppress(Exception):
                    future.result(10)
                loop.call_soon_threadsafe(loop.stop)
                thread.join(10)

            return Broker(kind="amqtt", version=version, host="127.0.0.1", port=port, _stop=stop)
        if loop.is_running():
            loop.call_soon_threadsafe(loop.stop)
    raise BrokerStartError(f"the embedded amqtt broker did not start after {attempts} tries")


def start_broker(prefer: Literal["auto", "mosquitto", "amqtt"] = "auto", *, federation: str | None = None,
                 workdir: Path | None = None) -> Broker:
    """Start a loopback broker: mosquitto when installed (or asked for), secured for ``federation`` when given, its
    files in ``workdir`` (see :func:`start_mosquitto`); else the embedded amqtt, which is never secured and keeps
    no files."""
    if prefer == "amqtt":
        return start_amqtt()
    binary = find_mosquitto()
    if binary is not None or prefer == "mosquitto":
        return start_mosquitto(binary, federation=federation, workdir=workdir)
    return start_amqtt()
