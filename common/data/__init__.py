"""Datasets, federated partitions and device-local data for FedFit."""

from common.data.datasets import DATASET_NAMES, Dataset, load_dataset, load_shard, subsample
from common.data.errors import DatasetError
from common.data.idx import read_idx
from common.data.local import load_local_data
from common.data.partition import PartitionSpec, label_set, parse_partition, partition_indices

__all__ = [
    "DATASET_NAMES",
    "Dataset",
    "DatasetError",
    "PartitionSpec",
    "label_set",
    "load_dataset",
    "load_local_data",
    "load_shard",
    "parse_partition",
    "partition_indices",
    "read_idx",
    "subsample",
]
