"""Tiers, aliases, routing rules and upstream servers: which model answers a request."""
