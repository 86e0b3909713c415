"""The forward's autocast state, for a rerun that runs under another one (notebook 03, step 3).

A rerun runs inside backward, whose autocast state is the caller's, not the forward's: the
region's forward may have run under ``torch.autocast`` and its backward outside it, or the other
way round. The frame keeps the forward's state (``None`` while autocast is off everywhere, the
common case: one call tells) and the rerun enters it only where it differs, since leaving an
autocast block clears autocast's cache of cast weights.
"""
from __future__ import annotations

from typing import ContextManager

import torch

__all__ = ["state", "contexts", "any_enabled"]

_DEVICES = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)

# Is autocast on for any device? One call (on a torch without it: always look at every device).
any_enabled = getattr(torch._C, "_is_any_autocast_enabled", lambda: True)


def state() -> tuple[tuple[str, bool, torch.dtype], ...] | None:
    """(device, enabled, dtype) for each device; ``None`` while autocast is off everywhere."""
    if not any_enabled():
        return None
    return tuple((device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
                 for device in _DEVICES)


def contexts(forward_state) -> list[ContextManager]:
    """The ``torch.autocast`` blocks that set ``forward_state`` (``None``: off everywhere)."""
    if forward_state is None:   # the forward ran without autocast: switch off what backward has
        forward_state = [(device, False, torch.get_autocast_dtype(device)) for device in _DEVICES]
    return [torch.autocast(device, dtype=dtype, enabled=enabled)
            for device, enabled, dtype in forward_state]
