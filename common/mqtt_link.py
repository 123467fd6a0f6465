"""One MQTT connection for a daemon, done the way the design asks of paho-mqtt 2.

- ``CallbackAPIVersion.VERSION2`` callbacks; MQTT 5 first, MQTT 3.1.1 when the broker refuses it
  (the embedded fallback broker speaks only 3.1.1, so nothing here depends on MQTT 5 properties).
- Subscriptions are (re)made in ``on_connect``, so a reconnect resubscribes.
- The network thread never runs application code: incoming messages go to a bounded queue drained by a
  dispatcher thread that calls the handler and logs (never propagates) its exceptions.
- The first connection is retried until a deadline, then fails with one clear sentence.
- A publish the broker refuses (an MQTT 5 PUBACK with a failure reason, e.g. "Not authorized" from its ACL) is
  logged and handed to ``on_refused`` off the network thread; the daemon decides whether it can go on. (Over
  MQTT 3.1.1 a broker drops a refused publish without a word, and Mosquitto 2.0 grants any subscription and
  filters what it delivers, so neither can be seen there.) A broker that closes the connection at a subscription
  it refuses (RabbitMQ) stops ``start`` with a sentence saying so once it has done it twice in a row (once could
  be a dropped connection), rather than after the timeout.
- ``call_soon`` runs a callable on the dispatcher thread, in turn with the messages: a daemon whose handlers
  keep state for one thread hands them work from its other threads that way, with no lock.
- ``pulse`` tells how long ago the dispatcher last got through its queue: what a watchdog should check, since
  it stays true through a broker outage and turns false when the daemon's own loop hangs.
"""

from __future__ import annotations

import contextlib
import queue
import ssl
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion

from common.logs import get_logger

MessageHandler = Callable[[str, bytes], None]
#: Called with (topic, reason) when the broker refuses one of our publishes.
RefusalHandler = Callable[[str, str], None]


class BrokerUnavailable(ConnectionError):
    """The broker could not be reached or refused us; the message says what to check."""


class BrokerRefused(RuntimeError):
    """The broker refused a publish the daemon cannot work without; the message says what to check."""


@dataclass
class BrokerConfig:
    """Where the MQTT broker listens and how to log in: the ``broker`` section of both daemons' configs.

    ``tls`` encrypts the connection and checks the broker's certificate against ``ca_file`` (the system's
    certificate authorities when None) and its host name. The password is given inline or, better, in
    ``password_file`` (its first line), which only the daemon's user can read.
    """

    host: str = "127.0.0.1"
    port: int = 1883
    username: str | None = None
    password: str | None = None
    password_file: str | None = None
    tls: bool = False
    ca_file: str | None = None
    keepalive: int = 30

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def secured(self) -> bool:
        """TLS and a login: what every connection outside a quick local try should have."""
        return self.tls and self.username is not None

    def validate(self) -> None:
        """Cross-field checks; raises ValueError with one clear sentence. (The files are read on connecting,
        where a missing one is a BrokerUnavailable that names it.)"""
        if not 0 < self.port < 65536:
            raise ValueError(f"broker.port must be in 1..65535, got {self.port}")
        if self.password is not None and self.password_file is not None:
            raise ValueError("broker: give either 'password' or 'password_file', not both")
        if (self.password is not None or self.password_file is not None) and self.username is None:
            raise ValueError("broker: a password needs a 'username' (a device's is its agent id)")
        if self.ca_file is not None and not self.tls:
            raise ValueError("broker.ca_file is set but broker.tls is false; set 'tls: true' to use it")
        if self.keepalive < 5:
            raise ValueError(f"broker.keepalive must be at least 5 s, got {self.keepalive}")

    def login(self) -> tuple[str, str | None] | None:
        """(username, password) to log in with, the password read from ``password_file`` when given; None when
        the configuration has no username. Raises BrokerUnavailable when the password file cannot be read."""
        if self.username is None:
            return None
        if self.password_file is None:
            return self.username, self.password
        try:
            with open(self.password_file, encoding="utf-8") as file:
                return self.username, file.readline().rstrip("\r\n")
        except (OSError, UnicodeDecodeError) as exc:
            raise BrokerUnavailable(f"cannot read broker.password_file {self.password_file!r} ({exc})") from exc


@dataclass(frozen=True)
class Will:
    """A Last Will: published by the broker when the connection drops without a clean disconnect."""

    topic: str
    payload: bytes
    retain: bool = True


_UNSUPPORTED_PROTOCOL = "Unsupported protocol version"
_NO_CONNACK = "no answer to CONNECT"
_CONNACK_WAIT_S = 3.0
_TLS_FAILED = "TLS: "
# Protocol each broker address last accepted, so that a fleet in one process probes MQTT 5 only once.
_accepted_protocol: dict[str, int] = {}
# Broker addresses this process has warned about connecting to without TLS or login (once each).
_warned_insecure: set[str] = set()
#: MQTT 5 DISCONNECT reason code: another client connected with the same client id (Mosquitto 2.0.11 does not
#: send it; it closes the connection).
_SESSION_TAKEN_OVER = 142
_NOT_AUTHORIZED = 135  # MQTT 5 reason code
_CLOSES_BEFORE_SUBACK = 2  # accepted connections closed before any SUBACK, in a row, that make a refusal
#: A connection the broker drops within this many seconds, this many times in a row, is taken for another client
#: with the same client id taking the session over each time the two reconnect.
_SHORT_CONNECTION_S = 5.0
_TAKEOVERS = 3
#: Topics of QoS 1 publishes still waiting for the broker's PUBACK kept at most (the oldest are forgotten).
_PENDING_TOPICS = 10_000
#: Marks a heartbeat in the dispatcher's queue (no MQTT topic is empty).
_PULSE = ("", b"")


@dataclass(frozen=True)
class _Call:
    """Work for the dispatcher thread (:meth:`MqttLink.call_soon`)."""

    work: Callable[[], object]


class LinkState(Enum):
    """Where a link is in its life. ``CONNECTING`` until its subscriptions are first acknowledged, then ``READY``
    (through an outage too: paho reconnects and resubscribes); ``STOPPING`` once ``stop()`` began, and
    ``TAKEN_OVER`` when another connection took its client id: both final, a disconnect then is no outage."""

    CONNECTING = "connecting"
    READY = "ready"
    STOPPING = "stopping"
    TAKEN_OVER = "taken over"

    @property
    def ending(self) -> bool:
        """Stopping or taken over: the link will not connect again."""
        return self in (LinkState.STOPPING, LinkState.TAKEN_OVER)


@dataclass
class _Handshake:
    """What one connection attempt of ``start()`` heard from the broker, paho's reconnects within it included:
    its CONNACK, the SUBACK of our subscriptions, and connections closed between the two."""

    connack: threading.Event = field(default_factory=threading.Event)  # a CONNACK came (or a close before it)
    connack_reason: str = ""  # "ok", or why there was no connection
    subscribe_mid: int | None = None  # the message id of our SUBSCRIBE
    subscribed: threading.Event = field(default_factory=threading.Event)  # a SUBACK came, granted or not
    refusals: list[tuple[str, str]] = field(default_factory=list)  # (topic, reason) the last SUBACK refused
    closes_before_suback: int = 0  # accepted connections closed before any SUBACK
    closed_before_suback: str | None = None  # set when start() must stop: a refusal by closing

    @property
    def awaiting_suback(self) -> bool:
        """Accepted and subscribed, no SUBACK yet."""
        return self.connack_reason == "ok" and self.subscribe_mid is not None and not self.subscribed.is_set()


@dataclass
class _Uptime:
    """The link's time with and without the broker (monotonic seconds)."""

    connected_at: float = 0.0
    down_since: float | None = None  # when the link lost the broker (None: connected, or never was)
    down_total: float = 0.0  # outages that ended
    short_drops: int = 0  # consecutive connections the broker dropped within _SHORT_CONNECTION_S
    lock: threading.Lock = field(default_factory=threading.Lock)

    def connected(self) -> None:
        """A connection was accepted: an outage, if any, ends."""
        self.connected_at = time.monotonic()
        with self.lock:
            if self.down_since is not None:
                self.down_total += self.connected_at - self.down_since
                self.down_since = None

    def dropped(self) -> float:
        """The connection dropped: an outage begins (if none has); the seconds the connection lasted."""
        with self.lock:
            if self.down_since is None:
                self.down_since = time.monotonic()
        lasted = time.monotonic() - self.connected_at
        self.short_drops = self.short_drops + 1 if lasted < _SHORT_CONNECTION_S else 0
        return lasted

    def outage_seconds(self) -> float:
        with self.lock:
            current = 0.0 if self.down_since is None else time.monotonic() - self.down_since
            return self.down_total + current


class MqttLink:
    """A resilient client: connect, subscribe, dispatch off the network thread, publish.

    When the broker hands this client id to another connection (MQTT 5 "Session taken over", or every connection
    dropped within seconds three times in a row), the link stays down (``taken_over``) and calls ``on_taken_over``
    once, off the network thread: reconnecting would knock the other off in turn.

    ``will`` is the Last Will, or a callable that makes it as :meth:`start` connects (so that it says what is true
    then, e.g. the round a coordinator is at).
    """

    def __init__(
        self,
        *,
        client_id: str,
        broker: BrokerConfig,
        subscriptions: Sequence[str],
        handler: MessageHandler,
        will: Will | Callable[[], Will] | None = None,
        on_ready: Callable[[], None] | None = None,
        queue_limit: int = 10_000,
        on_taken_over: Callable[[], None] | None = None,
        on_refused: RefusalHandler | None = None,
    ) -> None:
        self.client_id = client_id
        self.broker = broker
        self.subscriptions = list(subscriptions)
        self._handler = handler
        self._will = will
        self._on_ready = on_ready
        self._on_taken_over = on_taken_over
        self._on_refused = on_refused
        self._publish_lock = threading.Lock()
        self._room = threading.Condition(self._publish_lock)  # notified as PUBACKs take bytes out of flight
        # QoS 1 publishes by mid, until their PUBACK: (topic, payload bytes); their bytes summed in _in_flight
        self._pending_topics: OrderedDict[int, tuple[str, int]] = OrderedDict()
        self._in_flight = 0
        self._early_acks: OrderedDict[int, str | None] = OrderedDict()  # PUBACKs that beat publish(): the refusal
        self.refused_publishes = 0
        self._last_pulse = time.monotonic()  # when the dispatcher last got through a pulse
        self._state = LinkState.CONNECTING
        self._state_lock = threading.Lock()
        self.ready = threading.Event()  # set when the link first becomes READY, and stays set
        self._handshake = _Handshake()
        self._uptime = _Uptime()
        self._inbox: queue.Queue[tuple[str, bytes] | _Call | None] = queue.Queue(maxsize=queue_limit)
        self._client: mqtt.Client | None = None
        self.protocol_name = ""
        self._dispatcher: threading.Thread | None = None
        self._log = get_logger("mqtt", client_id=client_id)
        self.dropped_messages = 0

    # ----------------------------------------------------------------- lifecycle
    @property
    def state(self) -> LinkState:
        return self._state

    @property
    def taken_over(self) -> bool:
        """Another connection took this client id: the link stays down."""
        return self._state is LinkState.TAKEN_OVER

    def _become(self, state: LinkState) -> None:
        """Move to ``state``: to ``TAKEN_OVER`` from any state, to another only while the link is not ending."""
        with self._state_lock:
            if state is LinkState.TAKEN_OVER or not self._state.ending:
                self._state = state

    # ----------------------------------------------------------------- lifecycle
    def start(self, timeout: float = 30.0) -> None:
        """Connect (MQTT 5, else 3.1.1), subscribe and wait until the subscriptions are acknowledged."""
        self._warn_if_insecure()
        self._dispatcher = threading.Thread(target=self._dispatch_loop, name=f"{self.client_id}-dispatch",
                                            daemon=True)
        self._dispatcher.start()
        deadline = time.monotonic() + timeout
        delay = 0.2
        while True:
            outcome = self._connect(deadline)
            if outcome == "ok":
                self._await_subscriptions(deadline, timeout)
                return
            self._raise_if_refused(outcome)
            if time.monotonic() + delay > deadline:
                hint = "" if self.broker.tls else "; if the broker takes only TLS there, set broker.tls: true"
                raise BrokerUnavailable(f"cannot reach the MQTT broker at {self.broker} ({outcome}); check "
                                        f"that it is running and that host and port are right{hint}")
            time.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _warn_if_insecure(self) -> None:
        """Warn, once per broker address in this process, of a connection without TLS or login."""
        if not self.broker.secured and str(self.broker) not in _warned_insecure:
            _warned_insecure.add(str(self.broker))
            self._log.warning("mqtt_insecure", broker=str(self.broker), tls=self.broker.tls,
                              login=self.broker.username is not None,
                              message="no TLS or no login: anyone who can reach the broker can read and forge this "
                                      "federation's messages; use it only for quick local tries (fedfit broker init "
                                      "makes a secured one)")

    def _connect(self, deadline: float) -> str:
        """One round of connection tries: the protocol this broker address accepted before, else MQTT 5 and then
        3.1.1 (only where MQTT 5 was refused as such or went unanswered). "ok", or why the last try failed."""
        known = _accepted_protocol.get(str(self.broker))
        outcome = "no attempt made"
        for protocol in (known,) if known is not None else (mqtt.MQTTv5, mqtt.MQTTv311):
            outcome = self._attempt(protocol, deadline)
            if outcome == "ok":
                _accepted_protocol[str(self.broker)] = protocol
                return outcome
            if outcome not in (_UNSUPPORTED_PROTOCOL, _NO_CONNACK):
                break  # a protocol downgrade would not help
        return outcome

    def _await_subscriptions(self, deadline: float, timeout: float) -> None:
        """Wait for the SUBACK of the accepted connection; raise, the client abandoned, unless it made the link
        ready (a refused subscription, a connection closed at the subscriptions, or no answer in time)."""
        handshake = self._handshake
        handshake.subscribed.wait(max(0.5, deadline - time.monotonic()))
        if handshake.refusals:
            self._abandon_client()
            topics = ", ".join(f"{topic} ({reason})" for topic, reason in handshake.refusals)
            raise BrokerRefused(
                f"the MQTT broker at {self.broker} refused client '{self.client_id}' (user "
                f"{self.broker.username!r}) the subscription to {topics}: its ACL does not let this "
                f"login read there; check the agent_id / federation / username of the configuration")
        if handshake.closed_before_suback is not None and not self.ready.is_set():
            self._abandon_client()
            raise BrokerRefused(
                f"the MQTT broker at {self.broker} accepted client '{self.client_id}' (user "
                f"{self.broker.username!r}), then closed the connection at its subscriptions to "
                f"{', '.join(self.subscriptions)} without acknowledging them, "
                f"{handshake.closes_before_suback} time(s) in a row ({handshake.closed_before_suback}): "
                f"RabbitMQ does so when the login may not read one of them; check the agent_id / "
                f"federation / username of the configuration and the broker's permissions")
        if not self.ready.is_set():
            self._abandon_client()
            raise BrokerUnavailable(
                f"the MQTT broker at {self.broker} accepted the connection but did not acknowledge "
                f"the subscriptions within {timeout:.0f} s; check the broker's ACLs for "
                f"client '{self.client_id}'")

    def _raise_if_refused(self, outcome: str) -> None:
        """Raise at once for a failed connection that no retry mends: a refused login, a failed TLS handshake."""
        if "Not authorized" in outcome or "Bad user name or password" in outcome:
            raise BrokerUnavailable(f"the MQTT broker at {self.broker} refused client '{self.client_id}' "
                                    f"(user {self.broker.username!r}): {outcome}; check the username and "
                                    f"password")
        if outcome.startswith(_TLS_FAILED):
            raise BrokerUnavailable(f"the TLS handshake with the MQTT broker at {self.broker} failed "
                                    f"({outcome[len(_TLS_FAILED):]}); check broker.ca_file and that the "
                                    f"broker's certificate names {self.broker.host!r}")

    def stop(self, final: tuple[str, bytes, bool] | None = None, timeout: float = 5.0) -> None:
        """Publish ``final`` (topic, payload, retain) if given, disconnect cleanly and stop the threads."""
        self._become(LinkState.STOPPING)
        client = self._client
        if client is not None:
            if final is not None and client.is_connected():
                info = client.publish(final[0], final[1], qos=1, retain=final[2])
                try:
                    info.wait_for_publish(timeout)
                except (RuntimeError, ValueError):
                    pass
            client.disconnect()
            client.loop_stop()
        self._inbox.put(None) if not self._inbox.full() else None
        if self._dispatcher is not None and self._dispatcher is not threading.current_thread():
            self._dispatcher.join(timeout)

    # ------------------------------------------------------------------ publish
    def publish(self, topic: str, payload: bytes, *, qos: int = 1, retain: bool = False) -> bool:
        """Queue a message for sending; False when paho refused it outright (e.g. not connected)."""
        client = self._client
        if client is None:
            return False
        # Never call paho holding _publish_lock: paho runs on_publish holding its own lock, and on_publish takes
        # ours. A PUBACK may come back before the topic is stored: on_publish then leaves its verdict behind.
        info = client.publish(topic, payload, qos=qos, retain=retain)
        # (Another rc, e.g. MQTT_ERR_QUEUE_SIZE, means paho kept nothing under this mid: nothing to record.)
        if qos > 0 and info.rc in (mqtt.MQTT_ERR_SUCCESS, mqtt.MQTT_ERR_NO_CONN):
            with self._publish_lock:
                if info.mid in self._early_acks:
                    reason = self._early_acks.pop(info.mid)
                else:
                    reason = None
                    replaced = self._pending_topics.pop(info.mid, None)  # (a mid reused while still pending)
                    self._in_flight += len(payload) - (replaced[1] if replaced is not None else 0)
                    self._pending_topics[info.mid] = (topic, len(payload))
                    while len(self._pending_topics) > _PENDING_TOPICS:
                        self._in_flight -= self._pending_topics.popitem(last=False)[1][1]
            if reason is not None:
                self._refused(topic, reason)
        return info.rc == mqtt.MQTT_ERR_SUCCESS

    @property
    def bytes_in_flight(self) -> int:
        """Payload bytes of QoS 1 publishes queued or sent and not yet acknowledged by the broker."""
        with self._publish_lock:
            return self._in_flight

    def wait_for_room(self, limit: int, timeout: float) -> bool:
        """Wait until fewer than ``limit`` payload bytes are in flight (see `bytes_in_flight`): what a sender of
        many large messages calls before each, so that paho's queue, and this process's memory, hold about
        ``limit`` bytes of them rather than all at once. False when ``timeout`` seconds passed first (e.g. the
        broker is away)."""
        with self._room:
            return self._room.wait_for(lambda: self._in_flight < limit, timeout)

    def call_soon(self, work: Callable[[], object]) -> None:
        """Run ``work`` on the dispatcher thread after the messages received so far, as a handler runs (what it
        raises is logged); waits for room when the inbox is full. Work queued before :meth:`start` runs once the
        dispatcher does; work queued once the link is stopping may never run."""
        self._inbox.put(_Call(work))

    def backlog(self) -> int:
        """Messages received and not yet handled (the inbox's length)."""
        return self._inbox.qsize()

    def pulse(self) -> float:
        """Queue a heartbeat for the dispatcher and return the seconds since it last got through one (0 on the
        first call). Large while the dispatcher is stuck in a handler or dead; small through a broker outage."""
        if self._dispatcher is not None and self._dispatcher.is_alive():
            with contextlib.suppress(queue.Full):
                self._inbox.put_nowait(_PULSE)
        return time.monotonic() - self._last_pulse

    def outage_seconds(self) -> float:
        """Seconds the link has been without the broker since it was first ready (the current outage included)."""
        return self._uptime.outage_seconds()

    def down_for(self) -> float | None:
        """Seconds since the link lost the broker, in the outage going on (paho reconnecting); None while it is
        connected, and before it first was."""
        with self._uptime.lock:
            since = self._uptime.down_since
        return None if since is None else time.monotonic() - since

    @property
    def connected(self) -> bool:
        return self._client is not None and self._client.is_connected()

    # ---------------------------------------------------------------- internals
    def _attempt(self, protocol: int, deadline: float) -> str:
        """One connection try; returns "ok" or the reason it failed."""
        self._abandon_client()
        if protocol == mqtt.MQTTv5:
            client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=mqtt.MQTTv5)
        else:
            client = mqtt.Client(CallbackAPIVersion.VERSION2, client_id=self.client_id, protocol=mqtt.MQTTv311,
                                 clean_session=True)
        login = self.broker.login()
        if login is not None:
            client.username_pw_set(*login)
        if self.broker.tls:
            try:
                client.tls_set(ca_certs=self.broker.ca_file, cert_reqs=ssl.CERT_REQUIRED)
            except (OSError, ssl.SSLError) as exc:
                raise BrokerUnavailable(f"cannot use broker.ca_file {self.broker.ca_file!r} "
                                        f"({exc.strerror or exc})") from exc
        will = self._will() if callable(self._will) else self._will  # a callable's: what is true as start() connects
        if will is not None:
            client.will_set(will.topic, will.payload, qos=1, retain=will.retain)
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_subscribe = self._on_subscribe
        client.on_message = self._on_message
        client.on_publish = self._on_publish
        client.reconnect_delay_set(min_delay=1, max_delay=30)
        self._handshake = handshake = _Handshake()
        self._client = client
        try:
            client.connect(self.broker.host, self.broker.port, keepalive=self.broker.keepalive)
        except (ssl.SSLEOFError, ssl.SSLZeroReturnError, ssl.SSLSyscallError) as exc:
            self._client = None  # the broker went away mid-handshake (restarting, overloaded): worth another try
            return f"the TLS handshake was cut off: {exc}"
        except ssl.SSLError as exc:  # the certificate, or a listener without TLS: no retry mends that
            self._client = None
            return f"{_TLS_FAILED}{exc.reason or exc}"
        except (OSError, ValueError) as exc:
            self._client = None
            return str(exc) or type(exc).__name__
        client.loop_start()
        wait = max(0.5, min(_CONNACK_WAIT_S, deadline - time.monotonic()))
        if not handshake.connack.wait(wait):
            self._abandon_client()
            return _NO_CONNACK
        if handshake.connack_reason != "ok":
            reason = handshake.connack_reason
            self._abandon_client()
            return reason
        self.protocol_name = "MQTT 5" if protocol == mqtt.MQTTv5 else "MQTT 3.1.1"
        return "ok"

    def _abandon_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.on_disconnect = None
            client.on_connect = None
            try:
                client.disconnect()
            finally:
                client.loop_stop()

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any,
                    properties: Any) -> None:
        handshake = self._handshake
        if reason_code.is_failure:
            handshake.connack_reason = str(reason_code)
            handshake.connack.set()
            if self.ready.is_set():  # a reconnect that failed: paho will retry
                self._log.warning("mqtt_reconnect_refused", reason=str(reason_code))
            return
        handshake.connack_reason = "ok"
        self._uptime.connected()
        result, mid = client.subscribe([(topic, 1) for topic in self.subscriptions])
        handshake.subscribe_mid = mid if result == mqtt.MQTT_ERR_SUCCESS else None
        handshake.connack.set()
        if self.ready.is_set():
            self._log.info("mqtt_reconnected", broker=str(self.broker))

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, reason_codes: Any,
                      properties: Any) -> None:
        handshake = self._handshake
        if mid != handshake.subscribe_mid:
            return
        refused = [(topic, str(code)) for topic, code in zip(self.subscriptions, reason_codes) if code.is_failure]
        if refused:
            # (Mosquitto 2.0 grants every subscription and filters what it delivers; other brokers refuse here.)
            handshake.refusals = refused
            handshake.subscribed.set()
            self._log.error("mqtt_subscription_refused", refused=refused)
            if self.ready.is_set():  # a resubscription after a reconnect: the owner decides
                for topic, reason in refused:
                    self._refused(topic, reason, "subscription")
            return
        handshake.refusals = []
        first = not self.ready.is_set()
        self._become(LinkState.READY)
        self.ready.set()  # before subscribed: start() reads ready once subscribed wakes it
        handshake.subscribed.set()
        if self._on_ready is not None:
            try:
                self._on_ready()
            except Exception:  # noqa: BLE001 - never let a callback kill the network thread
                self._log.exception("on_ready_failed")
        if first:
            self._log.info("mqtt_ready", broker=str(self.broker), protocol=self.protocol_name)

    def _on_disconnect(self, client: mqtt.Client, userdata: Any, flags: Any, reason_code: Any,
                       properties: Any) -> None:
        handshake = self._handshake
        if not handshake.connack.is_set():
            handshake.connack_reason = (_UNSUPPORTED_PROTOCOL if client.protocol == mqtt.MQTTv5
                                        else f"connection closed before CONNACK ({reason_code})")
            handshake.connack.set()
        elif (not self._state.ending and not self.ready.is_set() and handshake.awaiting_suback
              and getattr(reason_code, "value", None) != _SESSION_TAKEN_OVER):
            # Accepted and subscribed, then closed without a SUBACK: how a broker that refuses a subscription by
            # closing the connection (RabbitMQ) answers, and also what a dropped connection looks like. paho
            # reconnects and subscribes again; a second close in a row (or MQTT 5's "Not authorized") is a
            # refusal, which start() then reports at once instead of waiting out its timeout.
            handshake.closes_before_suback += 1
            if (handshake.closes_before_suback >= _CLOSES_BEFORE_SUBACK
                    or getattr(reason_code, "value", None) == _NOT_AUTHORIZED):
                handshake.closed_before_suback = str(reason_code)
                handshake.subscribed.set()
            else:
                self._log.warning("mqtt_closed_before_suback", reason=str(reason_code),
                                  message="the broker closed the connection before acknowledging the "
                                          "subscriptions; trying once more")
        elif not self._state.ending:
            lasted = self._uptime.dropped()
            if getattr(reason_code, "value", None) == _SESSION_TAKEN_OVER or self._uptime.short_drops >= _TAKEOVERS:
                # Another client connected with this client id (the broker said so, or dropped every connection
                # within seconds, again and again): reconnecting would knock it off in turn, and the two would
                # take turns on the broker. Stop instead and say so.
                self._become(LinkState.TAKEN_OVER)
                self._log.error("mqtt_session_taken_over", reason=str(reason_code),
                                short_drops=self._uptime.short_drops)
                threading.Thread(target=self._give_up, args=(client,), name=f"{self.client_id}-taken-over",
                                 daemon=True).start()
            else:
                self._log.warning("mqtt_disconnected", reason=str(reason_code), seconds_connected=round(lasted, 1))

    def _give_up(self, client: mqtt.Client) -> None:
        """After a session takeover: stop the network loop (off its own thread), then tell the owner."""
        client.loop_stop()
        if self._on_taken_over is not None:
            self._on_taken_over()

    def _on_publish(self, client: mqtt.Client, userdata: Any, mid: int, reason_code: Any, properties: Any) -> None:
        failed = bool(getattr(reason_code, "is_failure", False))
        with self._publish_lock:
            pending = self._pending_topics.pop(mid, None)
            if pending is None:  # acked before publish() stored it (or a QoS 0 message)
                self._early_acks[mid] = str(reason_code) if failed else None
                while len(self._early_acks) > _PENDING_TOPICS:
                    self._early_acks.popitem(last=False)
            else:
                self._in_flight -= pending[1]
                self._room.notify_all()
        topic = pending[0] if pending is not None else None
        if topic is not None and failed:
            self._refused(topic, str(reason_code))

    def _refused(self, topic: str, reason: str, action: str = "publish") -> None:
        """Log a refused publish (or subscription) and hand it to ``on_refused`` off the network thread."""
        if action == "publish":
            self.refused_publishes += 1
        self._log.error(f"mqtt_{action}_refused", topic=topic, reason=reason, user=self.broker.username)
        if self._on_refused is not None:
            threading.Thread(target=self._on_refused, args=(topic, reason), name=f"{self.client_id}-refused",
                             daemon=True).start()

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:
            self._inbox.put_nowait((message.topic, bytes(message.payload)))
        except queue.Full:
            self.dropped_messages += 1
            self._log.warning("inbox_full_message_dropped", topic=message.topic)

    def _dispatch_loop(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None:
                return
            if item is _PULSE:
                self._last_pulse = time.monotonic()
                continue
            if isinstance(item, _Call):
                try:
                    item.work()
                except Exception:  # noqa: BLE001 - as a handler's: logged, the daemon goes on
                    with contextlib.suppress(Exception):
                        self._log.exception("queued_call_failed")
                continue
            topic, payload = item
            try:
                self._handler(topic, payload)
            except Exception:  # noqa: BLE001 - a bad message must never stop the daemon
                with contextlib.suppress(Exception):  # not even when logging itself fails
                    self._log.exception("message_handler_failed", topic=topic, size=len(payload))
