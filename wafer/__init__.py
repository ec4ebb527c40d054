"""wafer: a PyTorch inference engine behind an OpenAI-compatible API."""

__version__ = "0.1.0"
