"""Model families that can be built at any sub-model spec, with index maps, slicing and cost estimates
(parameters, FLOPs, and training memory: ``models.memory``).

Pure torch; nothing here knows about MQTT or the daemons.
"""

from models.family import ModelFamily
from models.layers import Scaler
from models.memory import BlockTrainingModel, MemoryEstimate, block_training_model, estimate_training_memory
from models.registry import FAMILY_NAMES, get_family
from models.spec import SubmodelSpec
from models.width import scaled_channels

__all__ = [
    "FAMILY_NAMES",
    "BlockTrainingModel",
    "MemoryEstimate",
    "ModelFamily",
    "Scaler",
    "SubmodelSpec",
    "block_training_model",
    "estimate_training_memory",
    "get_family",
    "scaled_channels",
]
