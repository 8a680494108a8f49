"""The generation cache the layers share (fla's ``fla.models.utils.Cache`` contract): one dict per
layer, ``{recurrent_state, attn_state, conv_state, ffn_state}``, read as ``cache[layer_idx]`` once
``len(cache) > layer_idx`` and written with ``update(layer_idx, ..., offset=T)``; an argument left
None keeps the old entry."""
from typing import Any, Dict, List, Optional

import torch

_KEYS = ("recurrent_state", "attn_state", "conv_state", "ffn_state")


class Cache:
    def __init__(self) -> None:
        self.states: List[Dict[str, Any]] = []
        self._seen_tokens = 0

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, layer_idx: int) -> Dict[str, Any]:
        return self.states[layer_idx]

    def update(self, layer_idx: int, recurrent_state=None, attn_state=None, conv_state=None,
               ffn_state=None, offset: int = 1) -> Dict[str, Any]:
        if layer_idx is None:
            raise ValueError("fla_ext: a layer given a cache needs its `layer_idx`")
        new = dict(zip(_KEYS, (recurrent_state, attn_state, conv_state, ffn_state)))
        while len(self.states) <= layer_idx:  # layers below an added one read empty states
            self.states.append(dict.fromkeys(_KEYS))
        for key, value in new.items():
            if value is not None:
                self.states[layer_idx][key] = value
        if layer_idx == 0:
            self._seen_tokens += offset
        return self.states[layer_idx]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._seen_tokens if len(self.states) > layer_idx else 0

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Beam search: keep the batch rows `beam_idx` of every state."""
        def pick(x):
            if isinstance(x, torch.Tensor):
                return x.index_select(0, beam_idx.to(x.device))
            if isinstance(x, (tuple, list)):
                return type(x)(pick(y) for y in x)
            return x
        for s in self.states:
            for key in _KEYS:
                s[key] = pick(s[key])


def layer_cache(cache: Optional["Cache"], layer_idx: Optional[int]) -> Optional[Dict[str, Any]]:
    """This layer's entry of `cache`, or None (no cache, or nothing stored for it yet). The
    layers reject a cache without a layer_idx before coming here (layers/checks.py)."""
    if cache is None or layer_idx is None or len(cache) <= layer_idx:
        return None
    return cache[layer_idx]
