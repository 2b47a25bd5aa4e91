"""The HTTP layer: OpenAI request and response bodies, error answers, request ids, the API key
middleware and admission limits. Knows nothing of models, replicas or the round loop."""
