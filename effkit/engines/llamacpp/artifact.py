"""A llama.cpp artifact folder: `model.gguf` (all llama.cpp needs), `gguf.json` (how it was written, its parity, what
it runs with), the Hugging Face `config.json` and tokenizer files (effkit's tokenizer and context), `effkit.json`;
and the lines that load it outside effkit."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from effkit.engines import as_exported
from effkit.engines.llamacpp.parity import parity_gate
from effkit.engines.llamacpp.q6k import head_storage
from effkit.engines.llamacpp.runtime import GGUF_DESC, GGUF_FILE, require, slots
from effkit.engines.llamacpp.writer import BLOCK, QUANTIZED, TYPES, check_model, refuse_shape, write_gguf
from effkit.engines.shared import save_config_and_tokenizer
from effkit.errors import EffkitError


def default_settings(threads: int, context: int | str) -> dict[str, Any]:
    """What effkit times a GGUF with: `threads` CPU threads, the server's slots, each with the model's `context`."""
    ctx = slots() * context if isinstance(context, int) else context
    return {"threads": threads, "parallel": slots(), "ctx": ctx, "batch": 2048, "ubatch": 512}



def load_line(gguf_path: Path, settings: dict[str, Any]) -> str:
    """The command lines that load `gguf_path` with the settings effkit times it with: llama.cpp's CLI and server,
    and Python (xllamacpp)."""
    s = settings
    return (f"llama-server -m {gguf_path} -t {s['threads']} -tb {s['threads']} -np {s['parallel']} -c {s['ctx']} "
            f"-b {s['batch']} -ub {s['ubatch']} --cache-ram 0 (one prompt: llama-cli -m {gguf_path} -t "
            f"{s['threads']} -tb {s['threads']}); Python: p = xllamacpp.CommonParams(); p.model.path = "
            f"'{gguf_path}'; p.cpuparams.n_threads = p.cpuparams_batch.n_threads = {s['threads']}; p.n_parallel = "
            f"{s['parallel']}; p.n_ctx = {s['ctx']}; p.cache_ram_mib = 0; xllamacpp.Server(p)")


def write_artifact(folder: Path, model, tokenizer, wtype: str = "f16", peer: bool = False) -> dict[str, Any]:
    """Write `model` into `folder` as one GGUF (`wtype`; the peer: f16 first, then Q8_0 from the f16 values, as a
    llama.cpp user converts and quantizes), its config and tokenizer, and `gguf.json`. Refused unless it passes the
    gate (`parity.parity_gate`). `model` is read, not copied, where it is on the CPU in fp32 (`engines.as_exported`)."""
    require()
    if wtype not in TYPES:
        raise EffkitError(f"unknown --type {wtype!r}; choose one of {', '.join(TYPES)}")
    with as_exported(model) as m:
        return _write_artifact(folder, m, tokenizer, wtype, peer)


def _write_artifact(folder: Path, model, tokenizer, wtype: str, peer: bool) -> dict[str, Any]:
    check_model(model)
    refuse_shape(model, wtype)
    threads = torch.get_num_threads()
    c = model.config
    settings = default_settings(threads, c.n_positions)
    t0 = time.perf_counter()
    weights = write_gguf(folder / GGUF_FILE, model, tokenizer, wtype, via_f16=peer,
                         record={"writer": "effkit", "timed_with": ", ".join(f"{k} {v}" for k, v in settings.items())})
    seconds = time.perf_counter() - t0
    save_config_and_tokenizer(folder, model, tokenizer)
    desc: dict[str, Any] = {
        "format": "gguf", "type": wtype, "weights": weights, "params": sum(p.numel() for p in model.parameters()),
        "converter": f"effkit's GGUFWriter (gguf-py {version('gguf')}): llama.cpp's GPT-2 tensors and keys, the "
                     "byte-level BPE with its merges inside"
                     + (", f16 then Q8_0 from the f16 values (as convert_hf_to_gguf.py --outtype f16 then "
                        "llama-quantize Q8_0)" if peer else ""),
        "quantizer": ("none (f16)" if wtype == "f16" else
                      f"gguf.quants.quantize {QUANTIZED[wtype]} (blocks of {BLOCK}, one f16 scale each)"
                      + (f"; {head_storage(c.n_embd, wtype)[1]}" if wtype == "q4_0" else "")),
        "convert_seconds": seconds, "threads": threads, "settings": settings,
        "runtime": f"llama.cpp (xllamacpp {version('xllamacpp')}): decoding and prefill by its server's completion "
                   f"route, {slots()} parallel sequences in one batch per step; logits for the held-out loss: its "
                   "final hidden states (/embeddings, pooling none) x the stored LM head (gguf-py, numpy)",
        **({"head": head_storage(c.n_embd, wtype)[1]} if wtype == "q4_0" else {}),
        **({"peer": True} if peer else {})}
    desc["parity"] = parity_gate(model, tokenizer, folder, "q8_0" if peer else wtype, threads)
    (folder / GGUF_DESC).write_text(json.dumps(desc, indent=2))
    return desc


def version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as v

    try:
        return v(package)
    except PackageNotFoundError:
        return "unknown"

