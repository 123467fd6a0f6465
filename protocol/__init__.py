"""FedFit wire contract: MQTT topics, message types, the msgpack codec and its validation.

Every payload is a msgpack map ``{"v": PROTOCOL_VERSION, "type": kind, **fields}`` with kind one of
``status``, ``coordinator_status``, ``task``, ``update``, ``ack``. Tensors are maps
``{"dtype", "shape", "data"}`` holding raw little-endian C-order bytes of a whitelisted dtype; nothing is ever
pickled. Large payloads travel as ``chunk`` maps of at most CHUNK_SIZE data bytes, put back together by a
`Reassembler`. `decode` enforces `Limits` and turns every malformed input into a `ProtocolError`.
A task says how to train as data: a versioned `TrainingPlan` (`protocol.plan`) and an `Adaptation` ladder.
Topics live under ``fedfit/v1/<federation>/`` (see `Topics`).
"""

from protocol.chunking import CHUNK_SIZE, Reassembler, TransferRefused, split_payload
from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.limits import DEFAULT_LIMITS, Limits
from protocol.messages import (
    MEMORY_DECLINE_REASON,
    MEMORY_KILL_REASON,
    PROTOCOL_VERSION,
    Ack,
    Adaptation,
    AgentStatus,
    Candidate,
    Capabilities,
    CoordinatorStatus,
    Message,
    ModelRef,
    Task,
    Update,
)
from protocol.plan import PLAN_VERSION, LossTerm, OptimizerSettings, Recipe, Stage, TrainingPlan
from protocol.tensors import decode_tensor, encode_tensor
from protocol.topics import Topics, parse_agent_topic, validate_name

__all__ = [
    "CHUNK_SIZE",
    "DEFAULT_LIMITS",
    "MEMORY_DECLINE_REASON",
    "MEMORY_KILL_REASON",
    "PLAN_VERSION",
    "PROTOCOL_VERSION",
    "Ack",
    "Adaptation",
    "AgentStatus",
    "Candidate",
    "Capabilities",
    "CoordinatorStatus",
    "Limits",
    "LossTerm",
    "Message",
    "ModelRef",
    "OptimizerSettings",
    "ProtocolError",
    "Reassembler",
    "Recipe",
    "Stage",
    "Task",
    "Topics",
    "TrainingPlan",
    "TransferRefused",
    "Update",
    "decode",
    "decode_tensor",
    "encode",
    "encode_tensor",
    "parse_agent_topic",
    "split_payload",
    "validate_name",
]
