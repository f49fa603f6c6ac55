"""nanolm: train a small language model yourself, from raw text to chat."""

__version__ = "0.1.0"
