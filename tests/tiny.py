"""Tiny randomly initialised models and a toy tokenizer, for fast tests of mechanics."""
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

VOCAB = 300


def tiny_model(seed: int = 0, layers: int = 2, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      **overrides)
    return Qwen2ForCausalLM(cfg).to(dtype).eval().requires_grad_(False)


class ToyTokenizer:
    """One token per character; enough for the engine's decode / stop-string paths."""
    eos_token_id = VOCAB - 1

    def encode(self, text, add_special_tokens=False):
        return [ord(c) % (VOCAB - 1) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids if i != self.eos_token_id)
