"""CTranslate2 through its own converter: the engine (`ENGINE`, what `effkit.registry.ENGINES` names) and the package
that owns the format, one job a module: `converter.py` writes an artifact with CTranslate2's `TransformersConverter`
and reads back what its `model.bin` stores; `runtime.py` runs it (`Ct2CausalLM`, its threads chosen per workload
by measurement, `thread_choices`). `effkit export --format ctranslate2` and `effkit quantize --backend ctranslate2`
both write through `ENGINE.convert`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from effkit.engines import Engine
from effkit.engines.ctranslate2.converter import weight_dtypes, write_artifact
from effkit.engines.ctranslate2.runtime import (  # noqa: F401 - thread_choices: named in the artifacts' description
    CT2_DESC,
    PORTABILITY,
    Ct2CausalLM,
    ct2_unavailable,
    thread_choices,
    threads_key,
)


class CTranslate2Engine(Engine):
    """CTranslate2 through its own converter."""

    name = "ctranslate2"
    marker = CT2_DESC
    label = "CTranslate2"
    noun = "a CTranslate2"  # "is a CTranslate2 artifact"
    summary = "CTranslate2 (its converter; int8 or float32 weights)"
    format = "ctranslate2"
    portability = PORTABILITY
    peer_tag = "peer-ctranslate2-int8"
    peer_how = ("ctranslate2.converters.TransformersConverter(reference).convert(out, quantization='int8'), run by "
                "ctranslate2.Generator (compute type int8); deviations from its defaults: intra_threads chosen per "
                "workload by effkit's measurement on this machine (one thread or torch's count, the row's notes say "
                "which), not CTranslate2's default")

    def available(self, device: torch.device | None = None, path: Path | None = None, compute_type: str | None = None,
                  int8: bool | None = None, **options: Any) -> str | None:
        if compute_type is None and int8 is not None:
            compute_type = "int8" if int8 else "float32"
        return ct2_unavailable(device, compute_type)

    def load(self, path: Path, device: torch.device) -> Ct2CausalLM:
        return Ct2CausalLM(path, device)

    def convert(self, folder: Path, source: Path, model: nn.Module, tokenizer, int8: bool = True,
                compute_type: str | None = None, **options: Any) -> dict[str, Any]:
        return write_artifact(folder, source, model.config, tokenizer, compute_type or ("int8" if int8 else "float32"),
                              sum(p.numel() for p in model.parameters()))

    def exported(self, desc: dict[str, Any], folder: Path, int8: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        return {"precision": desc["compute_type"], "runtime": desc["runtime"], "exporter": desc["converter"],
                "weights": weight_dtypes(folder)}, {}

    def write_peer(self, folder: Path, reference: Path, model: nn.Module, tokenizer) -> dict[str, Any]:
        return self.convert(folder, reference, model, tokenizer, compute_type="int8")

    def quantized_layers(self, model: nn.Module, path: Path | None = None) -> int:
        """The int8 weight matrices of the reloaded artifact's model.bin (every Linear of the blocks, the LM head)."""
        return weight_dtypes(model.path).get("int8", 0)

    def computation(self, path: Path) -> str | None:
        """sha256 over the converted model file (its layers and weights) and the compute type it runs with."""
        import hashlib

        try:
            desc = json.loads((Path(path) / CT2_DESC).read_text())
            h = hashlib.sha256(f"compute_type {desc['compute_type']}\n".encode())
            with open(Path(path) / "model.bin", "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
        except (OSError, ValueError, KeyError):
            return None
        return h.hexdigest()

    def load_command(self, path: Path) -> str:
        """With the thread count effkit timed it with on this machine (chosen per workload, `thread_choices`),
        where one was measured; CTranslate2's default otherwise."""
        from effkit.measure import machine_cache

        line = f"ctranslate2.Generator('{path}')"
        try:
            desc = json.loads((Path(path) / CT2_DESC).read_text())
            chosen, _ = machine_cache.machine_cached("ct2_threads", threads_key(desc["compute_type"], path), None)
        except (OSError, ValueError, KeyError, ImportError):
            chosen = None
        if not chosen:
            return line
        per = {k: v["threads"] for k, v in chosen.items()}
        line = f"ctranslate2.Generator('{path}', intra_threads={per.get('decode_b1', 1)})"
        if len(set(per.values())) > 1:
            line += " (timed with intra_threads " + ", ".join(f"{k.replace('_', ' ')} {n}" for k, n in per.items()) \
                + ": one Generator per thread count)"
        return line


ENGINE = CTranslate2Engine()
