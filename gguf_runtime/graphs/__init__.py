"""CUDA graph capture and replay (knows no model)."""

from .manager import GraphManager

__all__ = ["GraphManager"]
