"""The vocabulary map of a target and a drafter with different tokenizers: which token strings the
two share, and every token's text as bytes on both sides.

Token strings are compared normalised: a byte-level BPE piece (GPT-2, Qwen, Llama 3: `Ġ` for a
space, every byte a printable symbol) is decoded to its bytes; a SentencePiece piece (Gemma,
Llama 2, Mistral: `▁` for a space) has `▁` replaced by a space; added tokens that are not special
stand for their own text. A token is *shared* when its normalised text is valid UTF-8 on its own
(a piece holding part of a character is not) and a token of the other vocabulary has the same
text; special tokens and SentencePiece's byte-fallback pieces (`<0x41>`) are never shared, except
that the two EOS tokens are paired (a drafter may draft the end). Where one vocabulary holds two
tokens of one text, the lower id stands for it, so the shared ids map one to one both ways.

Every token's bytes (byte-fallback pieces their byte, special tokens their literal text) let a
drafter follow the target's text exactly, and re-encode text on either side (`encode_bytes`).

A map is built once per pair and cached under the fly-serve cache directory, keyed by a hash of
both tokenizers' serialisations (`VocabMap.between`): the pieces of a 262k vocabulary take a few
seconds to normalise.
"""

import hashlib
import logging
import os
import re
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("fly_serve.drafting.vocab_map")

FORMAT = 1  # bump when what a cached map holds changes
_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
# a token's kind in Vocab.kinds
TEXT, BYTE, SPECIAL = 0, 1, 2


def _byte_decoder() -> dict[str, int]:
    """The byte-level BPE alphabet: printable symbol -> byte (GPT-2's bytes_to_unicode, inverted)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {ch: b for b, ch in bytes_to_unicode().items()}


def is_byte_level(tokenizer) -> bool:
    """Whether the tokenizer's pieces are byte-level symbols (its decoder is ByteLevel)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return backend is not None and "ByteLevel" in repr(backend.decoder)


@dataclass
class Vocab:
    """One side's tokens: their bytes (concatenated, offsets [V + 1]), their kind (TEXT, BYTE,
    SPECIAL) and the id of each single byte's token where the vocabulary has one."""

    data: bytes
    offsets: np.ndarray  # [V + 1] int64
    kinds: np.ndarray  # [V] int8
    byte_ids: np.ndarray  # [256] int64, -1: no token of that byte alone
    eos: int | None

    @classmethod
    def of(cls, tokenizer) -> "Vocab":
        n = len(tokenizer)
        pieces: list[bytes] = [b""] * n
        kinds = np.full(n, SPECIAL, dtype=np.int8)
        byte_ids = np.full(256, -1, dtype=np.int64)
        decoder = _byte_decoder() if is_byte_level(tokenizer) else None
        added = tokenizer.added_tokens_decoder
        for piece, i in tokenizer.get_vocab().items():
            if i >= n:
                continue
            if i in added:
                token = added[i]
                pieces[i] = token.content.encode()
                kinds[i] = SPECIAL if token.special else TEXT
                continue
            if decoder is not None:
                try:
                    pieces[i], kinds[i] = bytes(decoder[ch] for ch in piece), TEXT
                except KeyError:  # not of the byte alphabet: a literal piece
                    pieces[i], kinds[i] = piece.encode(), TEXT
            elif m := _BYTE_FALLBACK.match(piece):
                pieces[i], kinds[i] = bytes([int(m.group(1), 16)]), BYTE
            else:
                pieces[i], kinds[i] = piece.replace("\u2581", " ").encode(), TEXT
        for i, p in enumerate(pieces):
            if len(p) == 1 and kinds[i] != SPECIAL and (byte_ids[p[0]] < 0 or kinds[i] == BYTE):
                byte_ids[p[0]] = i  # a byte-fallback piece first: it stands for the byte exactly
        offsets = np.zeros(n + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([len(p) for p in pieces])
        return cls(b"".join(pieces), offsets, kinds, byte_ids, tokenizer.eos_token_id)

    def __len__(self) -> int:
        return len(self.kinds)

    def piece(self, i: int) -> bytes:
        return self.data[self.offsets[i] : self.offsets[i + 1]]

    def text_of(self, ids) -> bytes:
        """The bytes of these tokens' text (a special token's literal text)."""
        return b"".join(self.piece(i) for i in ids)

    def shareable(self) -> dict[bytes, int]:
        """normalised text -> the lowest id of a TEXT token whose text is whole UTF-8."""
        out: dict[bytes, int] = {}
        for i in np.flatnonzero(self.kinds == TEXT).tolist():
            p = self.piece(i)
            if not p or p in out:
                continue
            try:
                p.decode("utf-8")
            except UnicodeDecodeError:
                continue
            out[p] = i
        return out


class VocabMap:
    """Shared ids both ways: to_drafter [V_target] and to_target [V_drafter] (-1: not shared), and
    both sides' Vocab."""

    def __init__(self, target: Vocab, drafter: Vocab, to_drafter: np.ndarray, to_target: np.ndarray):
        self.target, self.drafter = target, drafter
        self.to_drafter, self.to_target = to_drafter, to_target
        self.shared_target = torch.from_numpy(np.flatnonzero(to_drafter >= 0))  # [S]
        self.shared_drafter = torch.from_numpy(to_drafter[self.shared_target.numpy()])  # [S], aligned
        self._masks: dict[tuple[int, str], torch.Tensor] = {}

    @property
    def n_shared(self) -> int:
        return int(self.shared_target.numel())

    @classmethod
    def build(cls, target: Vocab, drafter: Vocab) -> "VocabMap":
        to_drafter = np.full(len(target), -1, dtype=np.int64)
        to_target = np.full(len(drafter), -1, dtype=np.int64)
        theirs = drafter.shareable()
        for text, t in target.shareable().items():
            d = theirs.get(text)
            if d is not None:
                to_drafter[t], to_target[d] = d, t
        t_eos, d_eos = target.eos, drafter.eos
        if t_eos is not None and d_eos is not None and t_eos < len(target) and d_eos < len(drafter):
            to_drafter[target.eos], to_target[drafter.eos] = drafter.eos, target.eos
        return cls(target, drafter, to_drafter, to_target)

    @classmethod
    def between(cls, target_tokenizer, drafter_tokenizer, cache: Path | None = None) -> "VocabMap":
        """The map of two tokenizers, from `cache` (a directory) when built there before."""
        path = None
        if cache is not None:
            h = hashlib.sha256(f"vocab-map-{FORMAT}".encode())
            for tok in (target_tokenizer, drafter_tokenizer):
                h.update(_fingerprint(tok))
            path = Path(cache) / "vocab-maps" / f"{h.hexdigest()[:24]}.npz"
            if path.is_file():
                try:
                    return cls.load(path)
                except (OSError, ValueError, KeyError):
                    log.warning("vocabulary map %s unreadable; building it again", path)
        out = cls.build(Vocab.of(target_tokenizer), Vocab.of(drafter_tokenizer))
        if path is not None:
            out.save(path)
        return out

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp.npz")
        arrays = {"to_drafter": self.to_drafter, "to_target": self.to_target}
        for side, v in (("t", self.target), ("d", self.drafter)):
            arrays |= {
                f"{side}_data": np.frombuffer(v.data, dtype=np.uint8),
                f"{side}_offsets": v.offsets,
                f"{side}_kinds": v.kinds,
                f"{side}_bytes": v.byte_ids,
                f"{side}_eos": np.array([-1 if v.eos is None else v.eos]),
            }
        np.savez(tmp, **arrays)
        os.replace(tmp, path)  # atomic: replicas starting together may write it at once

    @classmethod
    def load(cls, path: Path) -> "VocabMap":
        with np.load(path) as z:

            def side(s: str) -> Vocab:
                eos = int(z[f"{s}_eos"][0])
                data, offsets, kinds = z[f"{s}_data"].tobytes(), z[f"{s}_offsets"], z[f"{s}_kinds"]
                return Vocab(data, offsets, kinds, z[f"{s}_bytes"], None if eos < 0 else eos)

            return cls(side("t"), side("d"), z["to_drafter"], z["to_target"])

    # ---- TLI: the drafter's distribution limited to the shared tokens
    def drafter_mask(self, width: int, device) -> torch.Tensor:
        """[width] additive mask of the drafter's logits: 0 on shared ids, -inf elsewhere."""
        key = (width, str(device))
        if key not in self._masks:
            mask = torch.full((width,), float("-inf"))
            mask[self.shared_drafter[self.shared_drafter < width]] = 0.0
            self._masks[key] = mask.to(device)
        return self._masks[key]

    def q_to_target(self, q: torch.Tensor, width: int) -> torch.Tensor:
        """q [n, V_drafter] (zero off the shared ids) as [n, width] over the target's ids."""
        q = q.to_dense() if q.is_sparse else q
        out = torch.zeros(q.shape[0], width, dtype=q.dtype)
        keep = self.shared_target < width
        out[:, self.shared_target[keep]] = q[:, self.shared_drafter[keep]].cpu()
        return out


def _fingerprint(tokenizer) -> bytes:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    text = backend.to_str() if backend is not None else repr(sorted(tokenizer.get_vocab().items()))
    extra = f"|{len(tokenizer)}|{tokenizer.eos_token_id}|{sorted(tokenizer.added_tokens_decoder)}"
    return hashlib.sha256(text.encode() + extra.encode()).digest()


def encode_bytes(tokenizer, vocab: Vocab, data: bytes) -> list[int]:
    """Token ids of `data` in this vocabulary, no special tokens added: its valid UTF-8 stretches
    encoded by the tokenizer (as text that continues other text: `plain_encoder`), a byte that is
    not (part of a character cut off, or raw bytes) by the token of that byte, or, where the
    vocabulary has none, the replacement character's tokens."""
    encode = plain_encoder(tokenizer, vocab)
    out: list[int] = []
    while data:
        try:
            text, rest = data.decode("utf-8"), b""
        except UnicodeDecodeError as e:
            text, rest = data[: e.start].decode("utf-8"), data[e.start :]
        if text:
            out += encode(text)
        if rest:
            b = int(vocab.byte_ids[rest[0]])
            out += [b] if b >= 0 else encode("\ufffd")
            rest = rest[1:]
        data = rest
    return out


# Texts put in front of one to encode, then cut off, by a tokenizer that prepends a space: the
# first whose own tokens stay apart from the text's (one that merges with the text is skipped)
SENTINELS = ("\n", "a")
# tokenizer -> its sentinels' tokens where it prepends a space, else None (weak: no tokenizer kept)
_prepends: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def plain_encoder(tokenizer, vocab: Vocab):
    """text -> the tokenizer's ids of exactly that text, no special tokens added. A SentencePiece
    tokenizer that puts `▁` in front of every encoding (Llama 2, Mistral v1: Metaspace's prepend
    scheme "always" or "first", or a Prepend normalizer) would turn "abc" into " abc", and a stream
    re-encoded run by run would gain a space at every run: detected once per tokenizer (the text
    of "a"), such a tokenizer encodes behind a sentinel (SENTINELS) whose tokens are cut off, as
    transformers' own Llama tokenizer does behind its unk token."""

    def plain(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    try:
        heads = _prepends[tokenizer]
    except (KeyError, TypeError):
        heads = [(s, plain(s)) for s in SENTINELS] if vocab.text_of(plain("a")) == b" a" else None
        try:
            _prepends[tokenizer] = heads
        except TypeError:  # a tokenizer that takes no weak reference: detected again next time
            pass
    if heads is None:
        return plain

    def behind_sentinel(text: str) -> list[int]:
        want = text.encode()
        for sentinel, head in heads:
            ids = plain(sentinel + text)
            if ids[: len(head)] == head and vocab.text_of(ids[len(head) :]) == want:
                return ids[len(head) :]
        ids = plain(text)  # every sentinel merged with the text: its own encoding, less a lone space
        return ids[1:] if ids and vocab.text_of(ids[:1]) == b" " and not text.startswith(" ") else ids

    return behind_sentinel
