"""The model runtime: torch (runner, paged KV cache, graphs, TP) and llama.cpp, and the scorer on top."""
