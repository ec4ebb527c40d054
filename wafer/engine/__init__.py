"""The engine: sequences, KV cache, scheduling, the model runner and sampling."""
