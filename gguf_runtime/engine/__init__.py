"""The engine: a model loaded on a backend, generation with stops and budgets, chat sessions,
batched generation, and the choice of backend."""

from .engine import Engine, Generation, GenerationStats

__all__ = ["Engine", "Generation", "GenerationStats"]
