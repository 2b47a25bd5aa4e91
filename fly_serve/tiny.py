"""Tiny random models and a byte-level tokenizer, built in code (no files, no network): the
mechanics of the engine and the Serve app are tested on them in seconds. A name "tiny:N" loads
the tiny model of seed N everywhere a model name is accepted (loading.py)."""

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

_TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen's, same roles
TINY_VOCAB_SIZE = 256 + len(_TINY_SPECIALS)  # byte alphabet + specials
_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer (token id == byte value, no merges) with Qwen-style specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: b for b, ch in bytes_to_unicode().items()} | {t: 256 + i for i, t in enumerate(_TINY_SPECIALS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = _TINY_CHAT_TEMPLATE
    return tok


def tiny_model(seed: int = 0, vocab_size: int = TINY_VOCAB_SIZE, **overrides) -> Qwen2ForCausalLM:
    """Tiny random Qwen2 (fp32, eval) whose ids match tiny_tokenizer() by default."""
    cfg = dict(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=min(258, vocab_size - 1),
        pad_token_id=min(256, vocab_size - 1),
        bos_token_id=None,
    )
    cfg.update(overrides)
    with torch.random.fork_rng(devices=[]):  # deterministic per seed, leaves the global RNG alone
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(Qwen2Config(**cfg))
    return model.to(torch.float32).eval().requires_grad_(False)
