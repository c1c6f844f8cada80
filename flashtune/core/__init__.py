"""The types every layer shares: the attention problem and its buckets, the device
fingerprint, configs and search spaces, the tuning case, the implementation spec and the
exception hierarchy.

This is the lowest layer: it imports nothing else of flashtune, and nothing heavy on import
(torch is imported inside the functions that need it).
"""

from __future__ import annotations

from flashtune.core.case import TOLERANCE, Case, forward_case, random_inputs, relative_error
from flashtune.core.device import DeviceFingerprint
from flashtune.core.errors import FlashtuneError
from flashtune.core.problem import MAX_HEAD_DIM, AttentionProblem
from flashtune.core.space import Config, SearchSpace
from flashtune.core.spec import TemplateSpec

__all__ = ["MAX_HEAD_DIM", "TOLERANCE", "AttentionProblem", "Case",
           "Config", "DeviceFingerprint", "FlashtuneError", "SearchSpace", "TemplateSpec",
           "forward_case", "random_inputs", "relative_error"]
