"""Model families that can be built at any sub-model spec, with index maps, slicing, nesting and cost estimates
(parameters, FLOPs, and training memory: ``models.memory``), and the training-plan interpreter
(``models.training``).

Pure torch (and the wire contract's plain data types); nothing here knows about MQTT or the daemons.
"""

from models.depthwise import SegmentModel
from models.family import LayerDecl, ModelFamily
from models.layers import Scaler
from models.memory import MemoryEstimate, estimate_plan_memory, estimate_plan_stages
from models.net import FamilyNet
from models.registry import FAMILY_NAMES, get_family
from models.shapes import check_shapes
from models.spec import SubmodelSpec
from models.training import TrainResult, train
from models.width import ROUNDINGS, scaled_channels

__all__ = [
    "FAMILY_NAMES",
    "ROUNDINGS",
    "FamilyNet",
    "LayerDecl",
    "MemoryEstimate",
    "ModelFamily",
    "Scaler",
    "SegmentModel",
    "SubmodelSpec",
    "TrainResult",
    "check_shapes",
    "estimate_plan_memory",
    "estimate_plan_stages",
    "get_family",
    "scaled_channels",
    "train",
]
