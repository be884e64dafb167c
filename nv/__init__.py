"""NightVision: black-box inference of an LLM's hidden dimension, depth and parameter count."""

from nv.errors import NVError

__all__ = ["NVError"]
