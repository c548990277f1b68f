"""Keep only the accepted path in the KV cache after a tree verification.

The verify forward appends one cache entry per tree node. The accepted nodes are a root path,
so their entries move to the front of the tree's slot in order; the rejected ones are dropped.
Accepted tokens are never recomputed.
"""

from __future__ import annotations

import torch
from transformers import Cache, DynamicCache, PretrainedConfig


def sliding_window(config: PretrainedConfig) -> int | None:
    """The window of a model whose attention (some layers, or all) sees only the last
    `window` positions; None where every layer sees the whole context."""
    config = config.get_text_config(decoder=True)
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None and "sliding_attention" not in types:
        return None
    return int(window)


def rollback_cache(config: PretrainedConfig) -> DynamicCache:
    """A transformers cache that rejected rows can always be cut from. With sliding-window
    layers, transformers' own cache keeps only the window and cannot take back entries once the
    window has moved past them (`crop` then fails); so such a model's cache keeps every entry,
    and the window is the attention mask's work (`forward.HFForward`), as it is for any row."""
    if sliding_window(config) is not None:
        return DynamicCache()  # every layer a full layer
    return DynamicCache(config=config)


def keep_cache_entries(cache: Cache, prefix_len: int, kept_nodes: list[int]) -> None:
    """Shrink `cache` to its first `prefix_len` entries plus the tree nodes `kept_nodes`."""
    excess = cache.get_seq_length() - (prefix_len + len(kept_nodes))
    if kept_nodes != list(range(len(kept_nodes))):
        _move_entries(cache, prefix_len, kept_nodes)
    # Otherwise the accepted path is the first nodes in order (always so for one linear draft):
    # cropping is enough and copies nothing. Transformers' crop takes minus the count to remove.
    cache.crop(-excess)


def _move_entries(cache: Cache, prefix_len: int, kept_nodes: list[int]) -> None:
    # On the cache's own device: a CPU index into GPU keys would copy it at every layer.
    index = torch.tensor([prefix_len + node for node in kept_nodes],
                         device=cache.layers[0].keys.device)
    for layer in cache.layers:
        # Entries [prefix_len + k] <- [prefix_len + kept_nodes[k]]; the rest is cut off.
        kept = slice(prefix_len, prefix_len + len(kept_nodes))
        layer.keys[..., kept, :] = layer.keys[..., index, :]
        layer.values[..., kept, :] = layer.values[..., index, :]
