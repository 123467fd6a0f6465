"""Size limits applied while decoding untrusted payloads."""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Limits:
    """Upper bounds enforced by `decode`; every field must be a positive int.

    Attributes
    ----------
    max_payload_bytes: largest accepted payload (after chunk reassembly).
    max_tensor_elements: largest element count of one tensor.
    max_tensors: most tensors in one weights map.
    max_dims: most dimensions of one tensor.
    max_str_len: longest string (field values, map keys, tensor names).
    max_list_len: longest list or map (labels, spec lists, metrics).
    """

    max_payload_bytes: int = 512 * 2**20
    max_tensor_elements: int = 2**28
    max_tensors: int = 4096
    max_dims: int = 8
    max_str_len: int = 4096
    max_list_len: int = 100_000

    def __post_init__(self) -> None:
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{field.name} must be a positive int, got {value!r}")


DEFAULT_LIMITS = Limits()
