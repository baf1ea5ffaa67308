"""The CTranslate2 artifact written by CTranslate2's own `TransformersConverter` from an effkit (Hugging Face) GPT-2
folder (`write_artifact`), and what its `model.bin` stores, read from the file's headers (`weight_dtypes`).

A CTranslate2 artifact folder is a plain CTranslate2 model folder (`model.bin`, `vocabulary.json`, CTranslate2's
own `config.json`: `ctranslate2.Generator(path)` loads it), plus the tokenizer files, `hf_config.json` (the source's
`GPT2Config`: context, vocabulary), `ctranslate2.json` (how it was written and what it computes in) and
`effkit.json`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from effkit.engines.ctranslate2.runtime import CT2_DESC, HF_CONFIG
from effkit.errors import EffkitError

WEIGHT_TYPES = {"int8": "int8", "int8_float32": "int8", "int8_float16": "int8", "int8_bfloat16": "int8",
                "int16": "int16", "float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}
CT2_DTYPES = ("float32", "int8", "int16", "int32", "float16", "bfloat16")  # CTranslate2's DataType enum order

def write_artifact(folder: Path, source: Path, config, tokenizer, compute_type: str, params: int) -> dict[str, Any]:
    """Convert the Hugging Face GPT-2 folder `source` with CTranslate2's converter into `folder` (weights stored
    as `compute_type` needs them), with the tokenizer and the source's config; returns the description written
    to ctranslate2.json."""
    import ctranslate2

    if compute_type not in WEIGHT_TYPES:
        raise EffkitError(f"unknown CTranslate2 compute type {compute_type!r}; choose one of "
                          f"{', '.join(WEIGHT_TYPES)}")
    t0 = time.perf_counter()
    try:
        # force: `folder` exists (effkit's atomic temporary folder); the converter writes into it
        ctranslate2.converters.TransformersConverter(str(source)).convert(
            str(folder), quantization=WEIGHT_TYPES[compute_type], force=True)
    except Exception as e:  # noqa: BLE001 - the converter raises many kinds; the user needs one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise EffkitError(f"CTranslate2's converter cannot convert {source}: {type(e).__name__}: {first[:160]}") \
            from None
    tokenizer.save_pretrained(folder)
    fill_special_tokens(folder, tokenizer)
    (folder / HF_CONFIG).write_text(config.to_json_string())
    desc = {"format": "ctranslate2", "compute_type": compute_type, "weights": WEIGHT_TYPES[compute_type],
            "params": params,
            "converter": f"ctranslate2.converters.TransformersConverter(source).convert(out, quantization="
                         f"{WEIGHT_TYPES[compute_type]!r}), ctranslate2 {ctranslate2.__version__}",
            "convert_seconds": time.perf_counter() - t0,
            "runtime": "ctranslate2.Generator(path, compute_type, intra_threads chosen per workload by paired "
                       "measurement of 1 against torch's thread count; see effkit.engines.ctranslate2.thread_choices); "
                       "logits from "
                       "forward_batch, generation from generate_batch (KV cache, batched)"}
    (folder / CT2_DESC).write_text(json.dumps(desc, indent=2))
    return desc


def fill_special_tokens(folder: Path, tokenizer) -> list[str]:
    """CTranslate2 cannot load a model whose config.json has a null special token (its converter writes
    `unk_token: null` for a tokenizer without an unknown token, and loading then fails in its JSON reader). GPT-2's
    own tokenizer uses end-of-text for unknown, beginning and end: a missing one is filled with end-of-text (or
    the first special token there is). Returns the tokens it filled."""
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    fallback = tokenizer.eos_token or tokenizer.bos_token or next(iter(tokenizer.all_special_tokens), None)
    missing = [k for k in ("bos_token", "eos_token", "unk_token") if k in cfg and cfg[k] is None]
    if missing and fallback is None:
        raise EffkitError("the tokenizer has no special token at all, which CTranslate2 needs for unknown, "
                          "beginning and end of text; add one (e.g. <|endoftext|>) to the tokenizer and export again")
    for k in missing:
        cfg[k] = fallback
    if missing:
        path.write_text(json.dumps(cfg, indent=2))
    return missing


def weight_dtypes(path: Path) -> dict[str, int]:
    """The matrices (rank-2 variables) of a CTranslate2 `model.bin`, counted by stored dtype, read from the file's
    variable headers (the layout `ctranslate2.specs.ModelSpec._serialize` writes); the data is skipped."""
    import struct

    counts: dict[str, int] = {}
    with open(Path(path) / "model.bin", "rb") as f:
        def string() -> str:
            (n,) = struct.unpack("H", f.read(2))
            return f.read(n)[:-1].decode("utf-8", "replace")

        f.read(4)  # binary version
        string()  # spec name
        f.read(4)  # revision
        (n_vars,) = struct.unpack("I", f.read(4))
        for _ in range(n_vars):
            string()
            (rank,) = struct.unpack("B", f.read(1))
            f.read(4 * rank)
            (dtype,) = struct.unpack("B", f.read(1))
            (n_bytes,) = struct.unpack("I", f.read(4))
            f.seek(n_bytes, 1)
            if rank == 2:
                name = CT2_DTYPES[dtype] if dtype < len(CT2_DTYPES) else f"type {dtype}"
                counts[name] = counts.get(name, 0) + 1
    return counts
