"""Tiny random models and two tokenizers, built in code (no files, no network): the mechanics of
the engine and the Serve app are tested on them in seconds. A name "tiny:N" loads the tiny model
of seed N everywhere a model name is accepted (loading.py), with the byte-level tokenizer (Qwen's
kind); "tiny-sp:N" one of the SentencePiece-like tokenizer (Gemma's kind: `▁` for a space, merged
pieces, byte fallback, other special tokens and chat template), a drafter of another model family."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

_TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # Qwen's, same roles
TINY_VOCAB_SIZE = 256 + len(_TINY_SPECIALS)  # byte alphabet + specials
_TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_tokenizer(bos: str | None = None) -> PreTrainedTokenizerFast:
    """Byte-level tokenizer (token id == byte value, no merges) with Qwen-style specials.
    bos: also a BOS token of that text (id TINY_VOCAB_SIZE), added in front of every encoding
    with special tokens, as Llama 3's tokenizer adds <|begin_of_text|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    vocab = {ch: b for b, ch in bytes_to_unicode().items()} | {t: 256 + i for i, t in enumerate(_TINY_SPECIALS)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    if bos is not None:
        core.add_special_tokens([bos])
        core.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, TINY_VOCAB_SIZE)]
        )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        **({"bos_token": bos} if bos is not None else {}),
    )
    tok.chat_template = _TINY_CHAT_TEMPLATE
    return tok


# the tiny models' layers: GQA (4 query heads over 2 KV heads), as the real pairs have
TINY_SHAPE = dict(
    hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128
)


def tiny_model(seed: int = 0, vocab_size: int = TINY_VOCAB_SIZE, **overrides) -> Qwen2ForCausalLM:
    """Tiny random Qwen2 (fp32, eval) whose ids match tiny_tokenizer() by default."""
    cfg = dict(
        vocab_size=vocab_size,
        **TINY_SHAPE,
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


# Llama 3.1's rope scaling (its config.json), the part of a Llama config that Qwen2 lacks.
LLAMA31_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def tiny_llama(seed: int = 0, vocab_size: int = TINY_VOCAB_SIZE + 1, **overrides) -> LlamaForCausalLM:
    """Tiny random Llama with Llama 3.1's rope scaling (fp32, eval); the default vocabulary fits
    tiny_tokenizer(bos=...). A head_dim of 16 over a rope_theta of 500k puts rotary frequencies
    on both sides of the scaling's wavelength bands, so the scaling really changes the logits."""
    cfg = dict(
        vocab_size=vocab_size,
        **TINY_SHAPE,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rope_scaling=dict(LLAMA31_ROPE_SCALING),
        tie_word_embeddings=False,
        bos_token_id=TINY_VOCAB_SIZE,
        eos_token_id=min(258, vocab_size - 1),
        pad_token_id=min(256, vocab_size - 1),
    )
    cfg.update(overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    return model.to(torch.float32).eval().requires_grad_(False)


POISON_ID = 7  # the byte tokenizer's id of "\x07" (BEL): no test prompt holds it by chance


class Poisoned(RuntimeError):
    """What a poisoned tiny model raises: a request that fails for its own reasons."""


def poisoned(model):
    """The model, failing every forward whose input holds POISON_ID ("tiny:N:poison" in
    loading.py): a poison request fails alone, the others in its batch go on (engine bisection),
    and the service stays healthy (a health probe runs no forward)."""

    def check(_embedding, args):
        if bool((args[0] == POISON_ID).any()):
            raise Poisoned(f"poisoned input (token {POISON_ID})")

    # on the embedding: the runner calls the layers itself, never the model's own forward
    model.model.embed_tokens.register_forward_pre_hook(check)
    return model


# ---- a tokenizer of another family: SentencePiece-like pieces, as Gemma's
_SP_SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
# Characters the SentencePiece-like vocabulary lacks (byte fallback encodes them): a target token
# the drafter does not have
SP_MISSING = "Q~|`"
# Words merged into pieces (each with and without its word-start marker), so that a word is one
# drafter token and several target tokens
_SP_WORDS = (
    "the and def return print self for if in is not None True False import from class while else "
    "elif with as value result list len range data name int str er in on at re ing ed an or"
).split()
_SP_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def _sp_pieces() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """The SentencePiece-like vocabulary (specials, 256 byte-fallback pieces, characters, merged
    words) and the BPE merges that build the words from characters."""
    vocab = {t: i for i, t in enumerate(_SP_SPECIALS)}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    chars = [chr(c) for c in range(33, 127) if chr(c) not in SP_MISSING] + ["\u2581", "\n", "\t"]
    for ch in chars:
        vocab.setdefault(ch, len(vocab))
    merges: list[tuple[str, str]] = []

    def merge(a: str, b: str) -> None:
        if a + b not in vocab:
            merges.append((a, b))
            vocab[a + b] = len(vocab)

    for word in _SP_WORDS:
        for i in range(1, len(word)):
            merge(word[:i], word[i])
    for word in _SP_WORDS + ["\u2581"]:
        merge("\u2581", word)  # after the word: "▁the" is "▁" + "the"
    merge("\u2581" * 2, "\u2581" * 2)
    return vocab, merges


def tiny_sp_tokenizer(prepend: bool = False) -> PreTrainedTokenizerFast:
    """A SentencePiece-like BPE tokenizer (the `▁` word-start marker, merged pieces, byte fallback
    for what it lacks: SP_MISSING and every non-ASCII character) with Gemma's special tokens and
    chat template: another model family's tokenizer for the tiny cross-vocabulary pairs.
    prepend: a `▁` put in front of every encoding (Metaspace's prepend scheme "always", as Llama 2's
    and Mistral v1's tokenizers do: "abc" is encoded as " abc"), the same vocabulary."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    vocab, merges = _sp_pieces()
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>"))
    if prepend:
        core.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=False)
    else:
        core.normalizer = normalizers.Replace(" ", "\u2581")
    core.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    core.add_special_tokens(_SP_SPECIALS)
    core.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", "<end_of_turn>"],
    )
    tok.chat_template = _SP_CHAT_TEMPLATE
    return tok


def tiny_sp_vocab_size() -> int:
    return len(_sp_pieces()[0])
