"""Moved to nanolm/data/kinds/blocks.py (the input/output blocks kind); `block_views` stays here for
nanolm/train/objectives.py until it imports it from there."""

from nanolm.data.kinds.blocks import block_views

__all__ = ["block_views"]
