"""A tiny random model (tiny.py) written as a GGUF file, so that the llama.cpp runtime's mechanics
are tested on it in seconds, as the torch runtime's are on the model itself. fp32 tensors, the
qwen2 architecture and the byte-level vocabulary of tiny.tiny_tokenizer (or, `sp`, the
SentencePiece-like one of tiny.tiny_sp_tokenizer), which llama.cpp loads but never uses (token ids
come from our tokenizer)."""

import os
from pathlib import Path

import numpy as np

from .tiny import _TINY_SPECIALS, _sp_pieces, tiny_model, tiny_sp_vocab_size

# llama.cpp's names for the Hugging Face Qwen2 layer tensors
_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def _tensor_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)  # model.layers.<i>.<rest>
    return f"blk.{layer}.{_LAYER[rest]}"


def write_tiny_gguf(seed: int, path: Path, sp: bool = False) -> Path:
    """tiny_model(seed) as a GGUF file at `path` (written atomically); sp: the model of the
    SentencePiece-like tokenizer ("tiny-sp:N")."""
    import gguf

    if sp:
        model = tiny_model(seed, vocab_size=tiny_sp_vocab_size(), eos_token_id=1, pad_token_id=0, bos_token_id=2)
    else:
        model = tiny_model(seed)
    cfg = model.config
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), "qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    (_sp_vocabulary if sp else _byte_vocabulary)(w, gguf)
    w.add_eos_token_id(cfg.eos_token_id)
    w.add_pad_token_id(cfg.pad_token_id)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # llama.cpp reads a tied head from token_embd
        w.add_tensor(_tensor_name(name), t.detach().to("cpu").numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(path)
    return path


def _byte_vocabulary(w, gguf) -> None:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    pieces = [ch for _, ch in sorted((b, ch) for b, ch in bytes_to_unicode().items())] + _TINY_SPECIALS
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(pieces)
    w.add_token_types([gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * len(_TINY_SPECIALS))
    w.add_token_merges([f"{pieces[32]} {pieces[32]}"])  # llama.cpp wants merges; none is ever used


def _sp_vocabulary(w, gguf) -> None:
    """The SentencePiece-like vocabulary as llama.cpp's SPM kind: specials, byte pieces, the rest."""
    vocab, _ = _sp_pieces()
    pieces = sorted(vocab, key=vocab.get)
    kinds = [
        gguf.TokenType.CONTROL if i < 6 else gguf.TokenType.BYTE if i < 6 + 256 else gguf.TokenType.NORMAL
        for i in range(len(pieces))
    ]
    w.add_tokenizer_model("llama")
    w.add_token_list(pieces)
    w.add_token_scores([0.0] * len(pieces))
    w.add_token_types(kinds)
    w.add_bos_token_id(2)
