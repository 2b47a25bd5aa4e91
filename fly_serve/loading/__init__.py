"""Loading models: names, the embedded default pair, GGUF conversion, sharded loads, tiny test models."""
