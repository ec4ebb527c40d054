"""Model definitions (pure torch modules) and the loaders that build them from files."""
