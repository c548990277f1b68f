"""Token trees, acceptance, KV-cache compaction and the speculative loop."""

from dresd.decoding.generate import speculative_generate, supports_tree_attention
from dresd.decoding.sampling import SamplingConfig

__all__ = ["SamplingConfig", "speculative_generate", "supports_tree_attention"]
