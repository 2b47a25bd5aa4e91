"""The engine: its round, requests, parameters, prompts and text."""
