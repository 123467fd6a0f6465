"""A RabbitMQ cluster on loopback (three nodes by default) for runs and tests of a fleet larger than one broker.

Every node is a ``rabbitmq-server`` process of its own, started from a temporary directory: its own Erlang node
name, data directory, log, AMQP, distribution and MQTT ports (free ports on 127.0.0.1), the ``rabbitmq_mqtt``
plugin, and one Erlang port mapper (epmd) on a free port for the cluster alone, so that nothing collides with a
RabbitMQ or another cluster running on the machine. The first node boots alone; the others find it through
``classic_config`` peer discovery and join it. Readiness is polled against a deadline: each node's MQTT listener
(it opens at the end of its boot), then ``rabbitmqctl cluster_status`` until every node runs in the one cluster.
``stop()`` (also run at the interpreter's exit) ends every process started for the cluster, the Erlang helpers
that leave their parent's session included.

Secured (``federation`` given), every node takes only TLS (a certificate authority made here, as ``fedfit broker
init`` makes one) and logins, and every login gets topic permissions that mirror FedFit's Mosquitto ACL
(:func:`topic_permissions`): a device publishes only its own status and updates and reads only its own tasks,
acks and status and the coordinator's status; the coordinator reads every status and update and writes tasks,
acks and its own status. Unsecured, anonymous MQTT clients act as a user that may do anything.

What RabbitMQ's permissions cannot express: its MQTT plugin keeps a session in a queue named after the client id,
and queue (resource) permissions take no ``{username}`` variable, so every device login may configure every
``mqtt-subscription-*`` queue. Over MQTT that only lets it take a client id over (as Mosquitto 2 lets any login do);
over AMQP it could delete another client's queue, so the AMQP listener must be closed to devices (here it listens
on 127.0.0.1 only; a deployment sets ``listeners.tcp = none``).

RabbitMQ 3.10 speaks MQTT 3.1 and 3.1.1 only (FedFit's link falls back to 3.1.1 on its own), keeps retained messages
on the node they were published to (not replicated), and sends none to a subscription with a wildcard: see the
docs/deployment.md's section on broker clusters for what that means for FedFit.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import socket
import string
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from common.mqtt_link import BrokerConfig
from fedfit.secure_broker.pki import PkiError, make_ca, make_server_certificate
from fedfit.sim.broker import Broker, BrokerStartError, free_port, wait_for_login, wait_for_port
from protocol.topics import Topics, validate_name

#: Where the real scripts are (Debian's /usr/sbin ones are wrappers that switch to the rabbitmq user).
_SBIN_CANDIDATES = ("/usr/lib/rabbitmq/bin", "/usr/local/lib/rabbitmq/bin", "/opt/rabbitmq/sbin")
#: "/" <-> "." (MQTT topic levels <-> AMQP routing key words).
_SWAP = str.maketrans("/.", "./")
#: An environment variable every process started for a cluster carries (its value: the cluster's directory).
_MARK = "FEDFIT_RABBITMQ_CLUSTER"
#: The exchange RabbitMQ's MQTT plugin publishes to and binds subscriptions on.
MQTT_EXCHANGE = "amq.topic"
#: The login every node's admin user and unsecured MQTT clients use (refused as a client login).
_ADMIN = "fedfit-rabbitmq-admin"


def find_rabbitmq(sbin: str | None = None) -> Path | None:
    """The directory holding the real ``rabbitmq-server`` and ``rabbitmqctl`` scripts (not Debian's wrappers),
    or None when RabbitMQ is not installed."""
    candidates = [sbin] if sbin else list(_SBIN_CANDIDATES)
    for candidate in candidates:
        path = Path(candidate)
        if (path / "rabbitmq-server").exists() and (path / "rabbitmqctl").exists():
            return path
    return None


def rabbitmq_version(sbin: Path) -> str:
    """The version in the installed server's directory name (``rabbitmq_server-3.10.8`` -> "3.10.8")."""
    match = re.search(r"rabbitmq_server-([0-9][0-9A-Za-z.+~-]*)", str((sbin / "rabbitmq-server").resolve()))
    return match.group(1) if match else "unknown"


def routing_key(topic: str) -> str:
    """The AMQP routing key RabbitMQ's MQTT plugin makes of an MQTT topic: "/" becomes "." and "." becomes "/"."""
    return topic.translate(_SWAP)


def _exact(topic: str) -> str:
    return re.escape(routing_key(topic))


def topic_permissions(federation: str, name: str, coordinator: str) -> dict[str, str]:
    """The ``write`` and ``read`` regular expressions on ``amq.topic`` for login ``name`` of ``federation``, the
    twin of FedFit's Mosquitto ACL (``fedfit.secure_broker.acl``), matched against routing keys.

    A device's own topic level is ``{username}``, which RabbitMQ replaces with the login's name before matching
    (as Mosquitto's ``%u``). It replaces it verbatim, not escaped, and an agent id may hold ".", a regex wildcard
    (and a "/" in the routing key): such a device gets its name written out, escaped, instead.
    """
    topics = Topics(federation)
    agents = _exact(f"{topics.prefix}/agents")
    coordinator_status = _exact(topics.coordinator_status())
    if name == coordinator:
        return {"write": rf"^{agents}\.[^.]+\.(task|ack)$|^{coordinator_status}$",
                "read": rf"^{agents}\.[^.]+\.(status|update)$|^{coordinator_status}$"}
    own = "{username}" if "." not in validate_name(name, "login") else re.escape(routing_key(name))
    return {"write": rf"^{agents}\.{own}\.(status|update)$",
            "read": rf"^{agents}\.{own}\.(task|ack|status)$|^{coordinator_status}$"}


def password_hash(password: str, salt: bytes | None = None) -> str:
    """RabbitMQ's ``rabbit_password_hashing_sha256`` hash: base64(salt + sha256(salt + password)), 4-byte salt."""
    salt = secrets.token_bytes(4) if salt is None else salt
    return base64.b64encode(salt + hashlib.sha256(salt + password.encode()).digest()).decode()


@dataclass
class RabbitNode:
    """One node of the cluster: its Erlang name, ports and process."""

    index: int
    name: str
    mqtt_port: int
    amqp_port: int
    dist_port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    def log_tail(self, size: int = 800) -> str:
        """The end of what the node printed and logged, for an error message."""
        parts = []
        for path in (self.directory / "stdout.log", *sorted((self.directory / "log").glob("*.log"))):
            with contextlib.suppress(OSError):
                parts.append(path.read_text(errors="replace")[-size:].strip())
        return " | ".join(part for part in parts if part)[-size:]


@dataclass
class RabbitBroker(Broker):
    """One node of a :class:`RabbitCluster` seen as a :class:`~fedfit.sim.broker.Broker` (host, port, a login
    per client), so that anything taking a broker can be pointed at any node. ``stop()`` leaves the cluster be:
    the cluster stops it."""

    cluster: RabbitCluster | None = field(default=None, repr=False)
    node: int = 0

    @property
    def secured(self) -> bool:
        return self.cluster is not None and self.cluster.secured

    def client_config(self, name: str) -> BrokerConfig:
        """The ``broker`` section for login ``name`` on this node (the login is made when new)."""
        if self.cluster is None:
            return BrokerConfig(host=self.host, port=self.port)
        return self.cluster.client_config(name, node=self.node)

    def coordinator_config(self) -> BrokerConfig:
        """The coordinator's ``broker`` section on this node."""
        return self.client_config(self.cluster.coordinator if self.cluster else "coordinator")

    def add_logins(self, names: Sequence[str]) -> None:
        """Logins are the cluster's, the same on every node."""
        if self.cluster is not None:
            self.cluster.add_logins(names)


class RabbitCluster:
    """A running RabbitMQ cluster started by :func:`start_rabbitmq_cluster`; ``stop()`` ends every process it
    started (nodes, epmd) and removes its directory."""

    def __init__(self, sbin: Path, workdir: Path, nodes: list[RabbitNode], *, federation: str | None,
                 coordinator: str, tls: bool, epmd_port: int, epmd: subprocess.Popen[bytes]) -> None:
        self.sbin = sbin
        self.workdir = workdir
        self.nodes = nodes
        self.federation = federation
        self.coordinator = coordinator
        self.tls = tls and federation is not None
        self.version = rabbitmq_version(sbin)
        self._epmd_port = epmd_port
        self._epmd: subprocess.Popen[bytes] | None = epmd
        self._logins: set[str] = set()
        self._lock = threading.Lock()
        self._stopped = False
        atexit.register(self.stop)  # a script that forgets to stop it leaves no node behind

    # --------------------------------------------------------------- addresses
    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def ports(self) -> list[int]:
        """Every node's MQTT port (TLS when secured), node 0 first."""
        return [node.mqtt_port for node in self.nodes]

    @property
    def secured(self) -> bool:
        return self.federation is not None

    @property
    def brokers(self) -> list[RabbitBroker]:
        """A :class:`RabbitBroker` per node, node 0 first."""
        return [RabbitBroker(kind="external", version=f"RabbitMQ {self.version}", host=self.host,
                             port=node.mqtt_port, cluster=self, node=node.index) for node in self.nodes]

    def client_config(self, name: str, node: int = 0) -> BrokerConfig:
        """The ``broker`` section of login ``name`` (an agent id, or the coordinator's username) on ``node``,
        making the login when it is new; on an unsecured cluster, just host and port."""
        port = self.nodes[node].mqtt_port
        if not self.secured:
            return BrokerConfig(host=self.host, port=port)
        self.add_logins([name])
        return BrokerConfig(host=self.host, port=port, username=name,
                            password_file=str(self._password_file(name)), tls=self.tls,
                            ca_file=str(self.workdir / "tls" / "ca.crt") if self.tls else None)

    def coordinator_config(self, node: int = 0) -> BrokerConfig:
        """The coordinator's ``broker`` section on ``node``."""
        return self.client_config(self.coordinator, node)

    # ------------------------------------------------------------------ logins
    def _password_file(self, name: str) -> Path:
        return self.workdir / "clients" / f"{name}.password"

    def add_logins(self, names: Sequence[str]) -> None:
        """Give every new name a login with its topic permissions, in one ``rabbitmqctl import_definitions``
        (users and permissions are the cluster's, on every node once it returns)."""
        if not self.secured:
            return
        assert self.federation is not None
        with self._lock:
            new = [name for name in dict.fromkeys(names) if name not in self._logins]
            if not new:
                return
            users, permissions, topic_permissions_ = [], [], []
            clients = self.workdir / "clients"
            clients.mkdir(mode=0o700, exist_ok=True)
            for name in new:
                validate_name(name, "login")
                if name == _ADMIN:
                    raise ValueError(f"{_ADMIN!r} is the cluster's admin user; give the client another name")
                password = secrets.token_urlsafe(18)
                secret = self._password_file(name)
                descriptor = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(descriptor, "w") as handle:
                    handle.write(password + "\n")
                users.append({"name": name, "password_hash": password_hash(password),
                              "hashing_algorithm": "rabbit_password_hashing_sha256", "tags": []})
                # Queues of MQTT sessions are named mqtt-subscription-<client id>qos0/1: no {username} here.
                permissions.append({"user": name, "vhost": "/", "configure": "^mqtt-subscription-",
                                    "write": rf"^(mqtt-subscription-.*|{re.escape(MQTT_EXCHANGE)})$",
                                    "read": rf"^(mqtt-subscription-.*|{re.escape(MQTT_EXCHANGE)})$"})
                topic_permissions_.append({"user": name, "vhost": "/", "exchange": MQTT_EXCHANGE,
                                           **topic_permissions(self.federation, name, self.coordinator)})
            definitions = self.workdir / f"definitions-{secrets.token_hex(4)}.json"
            definitions.write_text(json.dumps({"users": users, "permissions": permissions,
                                               "topic_permissions": topic_permissions_}))
            try:
                self.ctl("import_definitions", str(definitions))
            finally:
                definitions.unlink(missing_ok=True)
            self._logins.update(new)
        probe = BrokerConfig(host=self.host, port=self.nodes[-1].mqtt_port, username=new[-1],
                             password_file=str(self._password_file(new[-1])), tls=self.tls,
                             ca_file=str(self.workdir / "tls" / "ca.crt") if self.tls else None)
        wait_for_login(probe, timeout=20.0)

    # ------------------------------------------------------------------- rabbitmqctl
    def env(self) -> dict[str, str]:
        """The environment every rabbitmq-server and rabbitmqctl of this cluster runs with."""
        return _environment(self.workdir, self._epmd_port)

    def ctl(self, *args: str, node: int = 0, timeout: float = 120.0, check: bool = True) -> str:
        """Run ``rabbitmqctl -n <node> ARGS`` and return its output; BrokerStartError when it fails and ``check``."""
        return _ctl(self.sbin, self.env(), self.nodes[node].name, args, timeout=timeout, check=check)

    def running_nodes(self, node: int = 0, timeout: float = 120.0) -> list[str]:
        """The cluster's running nodes, as ``node`` sees them."""
        output = self.ctl("cluster_status", "--formatter", "json", node=node, timeout=timeout)
        return list(json.loads(output).get("running_nodes", []))

    # ------------------------------------------------------------------- stop
    def processes(self) -> list[int]:
        """Ids of the live processes started for this cluster (nodes, their Erlang helpers, epmd, rabbitmqctl)."""
        return _marked(str(self.workdir))

    def stop_node(self, index: int, timeout: float = 60.0) -> None:
        """Stop one node (its process and children); the others stay up."""
        node = self.nodes[index]
        if node.process is not None:
            _end_group(node.process, timeout)
            node.process = None

    def stop(self, timeout: float = 60.0) -> None:
        """Stop every node and the epmd started here, and remove the cluster's directory. Only the first call
        does anything."""
        if self._stopped:
            return
        self._stopped = True
        atexit.unregister(self.stop)
        processes = [node.process for node in self.nodes if node.process is not None]
        for process in processes:  # all at once: each shuts down in parallel
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
        for process in processes:
            _end_group(process, timeout)
        for node in self.nodes:
            node.process = None
        if self._epmd is not None:
            _end_group(self._epmd, 10.0)
            self._epmd = None
        _end_marked(str(self.workdir), 10.0)
        shutil.rmtree(self.workdir, ignore_errors=True)


# ---------------------------------------------------------------------- start
def _environment(workdir: Path, epmd_port: int) -> dict[str, str]:
    return {
        **{key: value for key, value in os.environ.items() if not key.startswith(("RABBITMQ_", "ERL_"))},
        "HOME": str(workdir),  # the Erlang cookie is $HOME/.erlang.cookie, for nodes and rabbitmqctl alike
        "ERL_EPMD_PORT": str(epmd_port),
        "RABBITMQ_CONF_ENV_FILE": str(workdir / "rabbitmq-env.conf"),  # not /etc/rabbitmq's
        "LC_ALL": "C.UTF-8",
        _MARK: str(workdir),  # inherited by every process of the cluster, its helpers included (see _marked)
    }


def _ctl(sbin: Path, env: dict[str, str], node: str, args: Sequence[str], *, timeout: float,
         check: bool = True) -> str:
    try:
        result = subprocess.run([str(sbin / "rabbitmqctl"), "-q", "-n", node, *args], capture_output=True,
                                text=True, env=env, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        if check:
            raise BrokerStartError(f"rabbitmqctl {' '.join(args)} on {node} did not answer within {timeout:.0f} s")
        return ""
    if check and result.returncode != 0:
        raise BrokerStartError(f"rabbitmqctl {' '.join(args)} on {node} failed: "
                               f"{(result.stderr or result.stdout).strip()[-500:]}")
    return result.stdout


def _end_group(process: subprocess.Popen[bytes], timeout: float) -> None:
    """End a process started in its own session and everything in that session: SIGTERM (a node shuts down
    cleanly on it), SIGKILL after ``timeout`` seconds; returns once none of them is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    try:
        process.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass
    while time.monotonic() < deadline and _group_alive(process.pid):
        time.sleep(0.05)
    if _group_alive(process.pid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        kill_deadline = time.monotonic() + 10.0
        while time.monotonic() < kill_deadline and _group_alive(process.pid):
            time.sleep(0.05)
    if process.poll() is None:
        process.wait(5)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _marked(value: str) -> list[int]:
    """Processes whose environment has ``_MARK=value``: what Erlang's helpers (erl_child_setup, inet_gethost),
    which leave their parent's session, inherited from a node or a rabbitmqctl of this cluster."""
    needle = f"{_MARK}={value}".encode() + b"\0"
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                if needle in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
    return found


def _end_marked(value: str, timeout: float) -> None:
    """Wait for the helpers of a stopped cluster to leave (they do once their node or CLI is gone), then end any
    still there, by their process id."""
    deadline = time.monotonic() + timeout
    while _marked(value) and time.monotonic() < deadline:
        time.sleep(0.1)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _marked(value):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        grace = time.monotonic() + 2.0
        while _marked(value) and time.monotonic() < grace:
            time.sleep(0.05)


def _node_conf(node: RabbitNode, first: RabbitNode, *, secured: bool, tls_dir: Path | None,
               admin_password: str, memory_limit: str | None) -> str:
    lines = [
        f"listeners.tcp.default = 127.0.0.1:{node.amqp_port}",
        f"default_user = {_ADMIN}",
        f"default_pass = {admin_password}",
        "default_user_tags.administrator = true",
        "log.console = false",
        "log.file.level = warning",
        *([f"vm_memory_high_watermark.absolute = {memory_limit}"] if memory_limit else []),
        "mqtt.vhost = /",
        f"mqtt.exchange = {MQTT_EXCHANGE}",
    ]
    if tls_dir is not None:
        lines += [
            "mqtt.listeners.tcp = none",
            f"mqtt.listeners.ssl.default = 127.0.0.1:{node.mqtt_port}",
            f"ssl_options.cacertfile = {tls_dir / 'ca.crt'}",
            f"ssl_options.certfile = {tls_dir / 'server.crt'}",
            f"ssl_options.keyfile = {tls_dir / 'server.key'}",
            "ssl_options.verify = verify_none",
            "ssl_options.fail_if_no_peer_cert = false",
        ]
    else:
        lines.append(f"mqtt.listeners.tcp.default = 127.0.0.1:{node.mqtt_port}")
    if secured:
        lines.append("mqtt.allow_anonymous = false")
    else:  # anonymous MQTT clients act as the admin user, who may do anything
        lines += ["mqtt.allow_anonymous = true", f"mqtt.default_user = {_ADMIN}",
                  f"mqtt.default_pass = {admin_password}"]
    if node is not first:
        lines += ["cluster_formation.peer_discovery_backend = classic_config",
                  f"cluster_formation.classic_config.nodes.1 = {first.name}",
                  f"cluster_formation.classic_config.nodes.2 = {node.name}"]
    return "\n".join(lines) + "\n"


def _launch(sbin: Path, env: dict[str, str], node: RabbitNode) -> None:
    directory = node.directory
    node_env = {
        **env,
        "RABBITMQ_NODENAME": node.name,
        "RABBITMQ_DIST_PORT": str(node.dist_port),
        # Erlang distribution (full control of the node to whoever has the cookie) on loopback only.
        "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
        "RABBITMQ_CONFIG_FILE": str(directory / "rabbitmq.conf"),
        "RABBITMQ_ENABLED_PLUGINS_FILE": str(directory / "enabled_plugins"),
        "RABBITMQ_MNESIA_BASE": str(directory / "mnesia"),
        "RABBITMQ_LOG_BASE": str(directory / "log"),
        "RABBITMQ_PLUGINS_EXPAND_DIR": str(directory / "plugins-expand"),
        "RABBITMQ_PID_FILE": str(directory / "rabbitmq.pid"),
    }
    with (directory / "stdout.log").open("ab") as out:
        node.process = subprocess.Popen([str(sbin / "rabbitmq-server")], stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, env=node_env, cwd=directory,
                                        start_new_session=True)


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out to outgoing connections (32768 by default on Linux)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return 32768


def listen_port(used: set[int]) -> int:
    """A free port on 127.0.0.1 below the kernel's ephemeral range, not in ``used`` (which it joins).

    A node binds its ports seconds after they are chosen; a port of the ephemeral range (what binding port 0
    gives) may meanwhile become the local end of any outgoing connection on the machine, which a busy machine
    makes by the thousand."""
    low = min(_ephemeral_low(), 32768)
    for _ in range(1000):
        candidate = 10000 + secrets.randbelow(max(1, low - 10000))
        if candidate in used:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", candidate))
            except OSError:
                continue
        used.add(candidate)
        return candidate
    candidate = free_port()
    used.add(candidate)
    return candidate


def _port_open(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
        return True
    return False


def _await_listener(node: RabbitNode, deadline: float) -> None:
    """Wait until the node's MQTT listener accepts connections (it opens at the end of the boot, after the node
    joined its cluster); BrokerStartError at the deadline or when the node's process ends. (Polled with a TCP
    connection, not rabbitmqctl: every rabbitmqctl call costs a second of the CPU the booting nodes need.)"""
    while not _port_open(node.mqtt_port):
        if node.process is None or node.process.poll() is not None:
            raise _NodeExited(f"RabbitMQ node {node.name} exited while starting: {node.log_tail()}")
        if time.monotonic() > deadline:
            raise BrokerStartError(f"RabbitMQ node {node.name} did not start in time: {node.log_tail()}")
        time.sleep(0.1)


def _await_cluster(cluster: RabbitCluster, deadline: float) -> None:
    """Poll ``rabbitmqctl cluster_status`` on the first node until every node runs in its cluster; BrokerStartError
    at the deadline."""
    names = {node.name for node in cluster.nodes}
    while True:
        left = deadline - time.monotonic()
        try:
            running = set(cluster.running_nodes(timeout=max(5.0, left)))
        except (BrokerStartError, ValueError) as exc:
            running, error = set(), str(exc)
        else:
            error = ""
        if running == names:
            return
        if time.monotonic() > deadline:
            raise BrokerStartError(f"the RabbitMQ nodes did not form one cluster in time: the first sees "
                                   f"{sorted(running)} of {sorted(names)} {error}".strip())
        time.sleep(0.5)


def start_rabbitmq_cluster(nodes: int = 3, *, federation: str | None = None, coordinator: str = "coordinator",
                           tls: bool = True, memory_limit: str | None = None, sbin: str | None = None,
                           timeout: float = 180.0, attempts: int = 2) -> RabbitCluster:
    """Start ``nodes`` RabbitMQ nodes on 127.0.0.1, joined into one cluster, each with the MQTT plugin on a
    free port; return once every node runs and sees the others.

    With ``federation``, MQTT clients need a login (one per client, made by
    :meth:`RabbitCluster.client_config`/``add_logins``) with topic permissions as FedFit's ACL gives, over TLS
    unless ``tls`` is false; without, anyone on loopback may connect and do anything. ``memory_limit`` (e.g. "2GB")
    is each node's memory high watermark, past which the cluster stops reading from publishers until its queues
    drain (RabbitMQ's default: 40% of the machine's memory per node). BrokerStartError (with the
    node's log) when RabbitMQ is not installed or a node does not come up within ``timeout`` seconds; a node that
    exits while it starts costs a new try (``attempts`` in all) with other ports.
    """
    if nodes < 1:
        raise ValueError("a cluster needs at least one node")
    found = find_rabbitmq(sbin)
    epmd_binary = shutil.which("epmd") or next((str(path) for path in Path("/usr/lib/erlang/bin").glob("epmd")),
                                               None)
    if found is None or epmd_binary is None:
        raise BrokerStartError("RabbitMQ is not installed (apt-get install rabbitmq-server; then "
                               "`systemctl disable --now rabbitmq-server` so that its service holds no ports)")
    if federation is not None:
        validate_name(federation, "federation")
        validate_name(coordinator, "coordinator username")
    deadline = time.monotonic() + timeout
    for attempt in range(1, attempts + 1):
        try:
            return _start(found, epmd_binary, nodes, federation=federation, coordinator=coordinator, tls=tls,
                          memory_limit=memory_limit, deadline=deadline)
        except _NodeExited:
            if attempt == attempts or time.monotonic() > deadline:
                raise
    raise AssertionError("unreachable")


class _NodeExited(BrokerStartError):
    """A node ended while it started (a port taken meanwhile, say): worth another try with other ports."""


def _start(found: Path, epmd_binary: str, nodes: int, *, federation: str | None, coordinator: str, tls: bool,
           memory_limit: str | None, deadline: float) -> RabbitCluster:
    workdir = Path(tempfile.mkdtemp(prefix="fedfit-rabbitmq-"))
    cookie = workdir / ".erlang.cookie"
    cookie.write_text("".join(secrets.choice(string.ascii_uppercase) for _ in range(32)))
    cookie.chmod(0o400)
    (workdir / "rabbitmq-env.conf").write_text("")
    tag = secrets.token_hex(3)
    started: list[RabbitNode] = []
    epmd_port = listen_port(set())
    epmd = subprocess.Popen([epmd_binary, "-port", str(epmd_port), "-address", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                            env=_environment(workdir, epmd_port), start_new_session=True)
    cluster = RabbitCluster(found, workdir, started, federation=federation, coordinator=coordinator, tls=tls,
                            epmd_port=epmd_port, epmd=epmd)
    try:
        if not wait_for_port("127.0.0.1", epmd_port, 10.0):
            raise BrokerStartError(f"epmd did not listen on port {epmd_port}")
        tls_dir: Path | None = None
        if cluster.tls:
            tls_dir = workdir / "tls"
            tls_dir.mkdir(mode=0o700)
            try:
                ca = make_ca(tls_dir, f"FedFit RabbitMQ CA {federation}")
                make_server_certificate(tls_dir, ca, ["127.0.0.1", "localhost"])
            except PkiError as exc:
                raise BrokerStartError(f"cannot make the cluster's TLS certificates: {exc}") from None
        admin_password = secrets.token_urlsafe(18)
        (workdir / "admin.password").write_text(admin_password + "\n")
        (workdir / "admin.password").chmod(0o600)
        used: set[int] = {epmd_port}
        port = partial(listen_port, used)
        for index in range(nodes):
            directory = workdir / f"node{index}"
            directory.mkdir()
            started.append(RabbitNode(index=index, name=f"fedfit-{tag}-{index}@localhost", mqtt_port=port(),
                                      amqp_port=port(), dist_port=port(), directory=directory))
        for node in started:
            (node.directory / "rabbitmq.conf").write_text(_node_conf(node, started[0], secured=federation is not None,
                                                                     tls_dir=tls_dir, admin_password=admin_password,
                                                                     memory_limit=memory_limit))
            (node.directory / "enabled_plugins").write_text("[rabbitmq_mqtt].\n")
        env = cluster.env()
        _launch(found, env, started[0])
        _await_listener(started[0], deadline)
        for node in started[1:]:  # they join the first one as they boot (peer discovery: classic_config)
            _launch(found, env, node)
        for node in started[1:]:
            _await_listener(node, deadline)
        _await_cluster(cluster, deadline)
        if federation is not None:
            cluster.add_logins([coordinator])
        return cluster
    except BaseException:
        cluster.stop()
        raise
