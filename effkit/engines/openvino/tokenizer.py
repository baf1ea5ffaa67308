"""OpenVINO's tokenizer and detokenizer models in an artifact folder: what `openvino_genai.LLMPipeline` reads to
decode (effkit's own artifacts load without them; the peer, run as its users run it, needs them)."""

from __future__ import annotations

from pathlib import Path


def write_tokenizer_models(folder: Path, tokenizer) -> str:
    """OpenVINO's tokenizer and detokenizer models (what LLMPipeline reads), or why they are missing."""
    try:
        import openvino as ov
        from openvino_tokenizers import convert_tokenizer

        tok, detok = convert_tokenizer(tokenizer, with_detokenizer=True)
        ov.save_model(tok, str(folder / "openvino_tokenizer.xml"))
        ov.save_model(detok, str(folder / "openvino_detokenizer.xml"))
    except Exception as e:  # noqa: BLE001 - optional for effkit's own artifacts: the model loads without them
        return f"not written: openvino_tokenizers failed ({type(e).__name__}: {str(e)[:100]})"
    return "openvino_tokenizer.xml, openvino_detokenizer.xml (openvino_tokenizers.convert_tokenizer)"
