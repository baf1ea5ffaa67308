"""llama.cpp, one package that owns its format end to end: one GGUF file written by effkit's own converter
(`writer`, its Q4_0 head in Q6_K by llama.cpp's own quantizer: `q6k`), gated against PyTorch before anything is
written (`parity`), the artifact folder and its load line (`artifact`), run by llama.cpp's server behind effkit's
model interface (`runtime`: `LlamaCppCausalLM`). This module holds the engine (`ENGINE`) and its peer's
description: `effkit export --format gguf` and `effkit quantize --backend gguf` both write through `ENGINE.write`."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from effkit.engines import Engine, shared
from effkit.engines.llamacpp import artifact, runtime, writer
from effkit.engines.llamacpp.runtime import GGUF_DESC, GGUF_FILE, LlamaCppCausalLM, llamacpp_unavailable, slots
from effkit.errors import EffkitError


def peer_deviations() -> list[str]:
    """How effkit runs the peer other than with llama.cpp's defaults, one line each."""
    threads, default = torch.get_num_threads(), runtime.physical_cores()
    same = " (the same count)" if threads == default else ""
    return [f"-t / -tb {threads}: torch's thread count, so that every engine in the comparison gets the same threads; "
            f"llama.cpp's own default here is {default} (one per physical core){same}",
            f"-np {slots()} -c {slots()} x the model's context: {slots()} parallel sequences, each with "
            "the model's whole context (the server's default is fewer slots sharing one context)",
            "--cache-ram 0 and cache_prompt false per request: every timed call processes its prompts (the prompt "
            "cache would serve a repeated prompt from memory)",
            "greedy requests (temperature 0, top_k 1) with ignore_eos: they decode exactly the tokens every other "
            "engine decodes; the prompts handed over as token ids"]


class LlamaCppEngine(Engine):
    """llama.cpp over effkit's own GGUF writer, run by xllamacpp (llama.cpp's server in-process)."""

    name = "llamacpp"
    marker = GGUF_DESC
    label = "llama.cpp"
    noun = "a llama.cpp"  # "is a llama.cpp artifact"
    summary = "llama.cpp (one GGUF, tokenizer inside; f16, Q8_0 or Q4_0 by gguf-py, Q4_0's head Q6_K by ggml)"
    format = "gguf"
    types = writer.TYPES  # `effkit export --type`
    portability = runtime.PORTABILITY
    peer_tag = "peer-llamacpp"

    @property
    def settle_s(self) -> float:  # type: ignore[override]
        return runtime.settle_after(torch.get_num_threads())

    @property
    def peer_how(self) -> str:  # type: ignore[override]
        how = ("the reference as a llama.cpp user makes it: GGUF f16 (convert_hf_to_gguf.py's layout, here by effkit's "
               "writer) then llama-quantize Q8_0 from the f16 values, run by llama.cpp's server (xllamacpp.Server), "
               "several prompts as parallel sequences; held-out loss from its final hidden states (/embeddings, "
               "pooling none) x the stored LM head")
        if llamacpp_unavailable():
            return how
        return how + "; deviations from llama.cpp's defaults: " + "; ".join(peer_deviations())

    def available(self, device=None, path: Path | None = None, **options: Any) -> str | None:
        return shared.cpu_only(device, "llama.cpp", "xllamacpp's CPU wheels") or llamacpp_unavailable()

    def load(self, path: Path, device) -> LlamaCppCausalLM:
        shared.require_cpu(path, device, self.noun)
        return LlamaCppCausalLM.open(path)

    def write(self, folder: Path, model, tokenizer, wtype: str = "f16") -> dict[str, Any]:
        """Write `model` into `folder` as one GGUF of `wtype` (`writer.TYPES`), gated first: the one writer of
        `effkit export --format gguf` and `effkit quantize --backend gguf`."""
        return artifact.write_artifact(folder, model, tokenizer, wtype)

    def convert(self, folder: Path, source: Path, model, tokenizer, int8: bool = False, type: str = "",
                **options: Any) -> dict[str, Any]:
        wtype = type or ("q8_0" if int8 else "f16")
        if int8 and wtype not in writer.QUANTIZED:
            raise EffkitError(f"--int8 with --type {wtype}: give --type q8_0 or q4_0 alone")
        return self.write(folder, model, tokenizer, wtype)

    def exported(self, desc: dict[str, Any], folder: Path, int8: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        return ({"precision": desc["type"], "runtime": desc["runtime"], "exporter": desc["converter"],
                 "quantizer": desc["quantizer"], "weights": writer.tensor_types(folder / GGUF_FILE)},
                {"max_abs_logit_diff_vs_pytorch": desc["parity"]["max_abs_logit_diff"], "parity": desc["parity"]})

    def write_peer(self, folder: Path, reference: Path, model, tokenizer) -> dict[str, Any]:
        desc = artifact.write_artifact(folder, model, tokenizer, "q8_0", peer=True)
        desc["deviations"] = peer_deviations()
        (folder / GGUF_DESC).write_text(json.dumps(desc, indent=2))
        return desc

    def prefill(self, model: LlamaCppCausalLM, batch: int, tokens: int):
        """llama.cpp's prefill as its server runs it: `batch` prompts of `tokens` fixed random ids as parallel
        sequences, and their first new token (logits of the last position only, as llama.cpp computes them);
        seconds."""
        from effkit.measure import timing

        rows = timing.random_tokens(model, batch, tokens).tolist()
        rows = [r[:tokens - 1] for r in rows] if tokens >= model.config.n_positions else rows  # + 1 new token

        def once() -> float:
            t = time.perf_counter()
            model.complete(rows, 1)
            return time.perf_counter() - t

        once.settle_s = model.settle_s
        return once

    def decode(self, model: LlamaCppCausalLM, tokenizer, batch: int, new_tokens: int,
               generate_kwargs: dict[str, Any] | None = None, prompts: list[Any] | None = None):
        """Greedy decoding of `new_tokens` by llama.cpp's server from the prompts of its round (`prompts`, handed
        over as those token ids, `generation.by_round`; default: `batch` copies of the fixed prompt), its own loop:
        the rows as parallel sequences, one batch per step; new tokens per second of all rows; every call checks
        that each row made all its tokens."""
        from effkit.measure import generation

        def once(ids) -> float:
            t = time.perf_counter()
            r = model.complete(ids.tolist(), new_tokens)
            seconds = time.perf_counter() - t
            # every row ran to its last token (llama.cpp's usage counts one row of a multi-prompt request)
            stopped = [c.get("finish_reason") for c in r["choices"] if c.get("finish_reason") != "length"]
            if stopped or r.get("usage", {}).get("completion_tokens", new_tokens) != new_tokens:
                raise EffkitError(f"llama.cpp stopped decoding before {new_tokens} new tokens "
                                  f"({stopped or r['usage']})")
            return len(ids) * new_tokens / seconds

        return generation.by_round(prompts or generation.prompt_batches(tokenizer, batch), once, model.settle_s)

    def quantized_layers(self, model, path: Path | None = None) -> int:
        where = Path(path) / GGUF_FILE if path is not None else model.gguf
        return sum(n for k, n in writer.tensor_types(where).items() if k not in ("F32", "F16", "BF16"))

    def load_command(self, path: Path) -> str:
        """llama.cpp's CLI / server line and the Python (xllamacpp) line, with the settings effkit times it with
        (its threads: torch's count here; the server's slots and context for batch 12)."""
        desc = self.describe(path)
        settings = desc.get("settings") or artifact.default_settings(torch.get_num_threads(), "<slots x context>")
        settings = {**settings, "threads": torch.get_num_threads()}
        return artifact.load_line(Path(path) / GGUF_FILE, settings)


ENGINE = LlamaCppEngine()
