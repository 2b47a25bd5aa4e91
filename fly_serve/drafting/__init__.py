"""Drafts: the model drafter, model-free sources (prompt lookup, suffix index, recycling), draft-ahead."""
