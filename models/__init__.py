"""Model families that can be built at any sub-model spec, with index maps, slicing and cost estimates.

Pure torch; nothing here knows about MQTT or the daemons.
"""

from models.family import ModelFamily
from models.layers import Scaler
from models.registry import FAMILY_NAMES, get_family
from models.spec import SubmodelSpec
from models.width import scaled_channels

__all__ = ["FAMILY_NAMES", "ModelFamily", "Scaler", "SubmodelSpec", "get_family", "scaled_channels"]
