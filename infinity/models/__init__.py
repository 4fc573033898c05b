"""Models larger than RAM: a local Hugging Face checkpoint streamed into the store
(`load`); see docs/scale.md."""

from infinity.models._load import DEFAULT_WINDOW, load

__all__ = ["DEFAULT_WINDOW", "load"]
