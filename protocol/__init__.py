"""FedFit wire contract: MQTT topics, message types, the msgpack codec and its validation.

Every payload is a msgpack map ``{"v": version, "type": kind, **fields}`` with kind one of ``status``,
``coordinator_status``, ``task``, ``update``, ``ack``, ``upload_request``, ``upload_grant``, ``upload_wait``, ``model_delivery`` and the secure round's
(`protocol.secure`).
Tensors hold raw little-endian C-order bytes of a whitelisted dtype: in version 1 as maps ``{"dtype", "shape",
"data"}`` inside the message, in version 2 (PROTOCOL_VERSION) after it (`protocol.framing`), encoded without a
copy (`encode_parts`) and decoded as read-only views on the received bytes. `decode` reads both versions,
`encode` writes either (``version=1`` for an agent whose `Capabilities` do not say it reads 2); nothing is
ever pickled. Large payloads travel as ``chunk`` maps of at most CHUNK_SIZE data bytes (`iter_chunks`,
`split_payload`), put back together by a `Reassembler`. `decode` enforces `Limits` and turns every malformed
input into a `ProtocolError`.
A task says how to train as data: a versioned `TrainingPlan` (`protocol.plan`) and an `Adaptation` ladder.
Topics live under ``fedfit/v1/<federation>/`` (see `Topics`).
"""

from protocol.chunking import CHUNK_SIZE, iter_chunks, split_payload
from protocol.codec import BytesLike, decode, encode, encode_parts, message_type, payload_version
from protocol.errors import ProtocolError
from protocol.framing import Encoded
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import (
    HEAD_ALONE_REVISION,
    MEMORY_DECLINE_REASON,
    MEMORY_KILL_REASON,
    MODEL_DELIVERY_REVISION,
    ORDERED_DROPOUT_REVISION,
    PRIVACY_REVISION,
    PROTOCOL_REVISION,
    PROTOCOL_VERSION,
    READABLE_VERSIONS,
    SECURE_AGGREGATION_REVISION,
    STATUS_REPORT_REVISION,
    UPLOAD_GRANT_REVISION,
    UPLOAD_WAIT_REVISION,
    Ack,
    Adaptation,
    AgentReport,
    AgentStatus,
    Candidate,
    Capabilities,
    CoordinatorStatus,
    Message,
    ModelDelivery,
    ModelRef,
    PrivacySpent,
    RoundProgress,
    Task,
    TextEnum,
    Update,
    UpdateStatus,
    UploadGrant,
    UploadRequest,
    UploadWait,
)
from protocol.plan import PLAN_VERSION, LossTerm, OptimizerSettings, Recipe, Stage, TrainingPlan, UpdateClip
from protocol.reassembly import Reassembled, Reassembler, TransferRefused
from protocol.secure import (
    RevealedShare,
    SecureAdvert,
    SecurePeer,
    SecureRelay,
    SecureReveal,
    SecureRoster,
    SecureShares,
    SecureUnmask,
)
from protocol.tensors import decode_tensor, encode_tensor
from protocol.topics import Topics, parse_agent_topic, validate_name

__all__ = [
    "CHUNK_SIZE",
    "DEFAULT_LIMITS",
    "HEAD_ALONE_REVISION",
    "MEMORY_DECLINE_REASON",
    "MEMORY_KILL_REASON",
    "MODEL_DELIVERY_REVISION",
    "ORDERED_DROPOUT_REVISION",
    "PLAN_VERSION",
    "PRIVACY_REVISION",
    "PROTOCOL_REVISION",
    "PROTOCOL_VERSION",
    "READABLE_VERSIONS",
    "SECURE_AGGREGATION_REVISION",
    "STATUS_REPORT_REVISION",
    "UPLOAD_GRANT_REVISION",
    "UPLOAD_WAIT_REVISION",
    "Ack",
    "Adaptation",
    "AgentReport",
    "AgentStatus",
    "BytesLike",
    "Candidate",
    "Capabilities",
    "CoordinatorStatus",
    "Encoded",
    "Limits",
    "LossTerm",
    "Message",
    "ModelDelivery",
    "ModelRef",
    "OptimizerSettings",
    "PrivacySpent",
    "ProtocolError",
    "Reassembled",
    "Reassembler",
    "Recipe",
    "RevealedShare",
    "RoundProgress",
    "SecureAdvert",
    "SecurePeer",
    "SecureRelay",
    "SecureReveal",
    "SecureRoster",
    "SecureShares",
    "SecureUnmask",
    "Stage",
    "Task",
    "TextEnum",
    "Topics",
    "TrainingPlan",
    "TransferRefused",
    "Update",
    "UpdateClip",
    "UpdateStatus",
    "UploadGrant",
    "UploadRequest",
    "UploadWait",
    "decode",
    "decode_tensor",
    "encode",
    "encode_parts",
    "encode_tensor",
    "iter_chunks",
    "message_type",
    "parse_agent_topic",
    "payload_version",
    "split_payload",
    "validate_name",
]
