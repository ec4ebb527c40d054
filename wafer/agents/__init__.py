"""Agents over the engine or any upstream: the Responses API, programmatic tool calling."""
