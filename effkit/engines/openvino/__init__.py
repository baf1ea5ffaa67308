"""OpenVINO, one package that owns its format end to end: the model converted by OpenVINO's PyTorch front end into
the stateful layout `optimum-cli export openvino` writes (`convert`), its weights compressed by NNCF (`compress`),
the settings it runs with recorded where plain OpenVINO reads them (`settings`), run behind effkit's model interface
(`runtime`: `OpenVINOCausalLM`, LLMPipeline checked against effkit's loop), its inference precision and attention
backend chosen by measurement (`tune`), gated against PyTorch before anything is written (`convert.check_parity`),
with OpenVINO's tokenizer models (`tokenizer`). This module holds the engine (`ENGINE`) and its peer's description:
`effkit export --format openvino` and `effkit quantize --backend openvino` both write through `ENGINE.write`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from effkit.engines import Engine, shared
from effkit.engines.openvino import compress, convert, settings, tune
from effkit.engines.openvino.runtime import OpenVINOCausalLM
from effkit.errors import EffkitError


def peer_deviations() -> list[str]:
    """How effkit runs the peer other than with LLMPipeline's and OpenVINO's defaults, one line each."""
    threads, plain = torch.get_num_threads(), settings.plain_compile_settings()["INFERENCE_NUM_THREADS"]
    same = " (the same count)" if str(threads) == plain else ""
    return [f"INFERENCE_NUM_THREADS={threads}: torch's thread count, so that every engine in the comparison gets the "
            f"same threads; OpenVINO's own default here is {plain}{same}",
            "the prompt handed over as token ids (openvino_genai.TokenizedInputs): tokenizing is not timed",
            "a greedy GenerationConfig with min_new_tokens = max_new_tokens and ignore_eos=True: it decodes exactly "
            "the tokens every other engine decodes"]


class OpenVINOEngine(Engine):
    """OpenVINO through its PyTorch front end, in optimum-intel's stateful layout."""

    name = "openvino"
    marker = settings.OV_DESC
    label = "OpenVINO"
    noun = "an OpenVINO"  # "is an OpenVINO artifact"
    summary = ("OpenVINO (stateful IR as optimum-cli writes it; fp32, int8 or int4 weights, int4 data-free or "
               "data-aware; bf16 or f32 inference)")
    format = "openvino"
    portability = settings.PORTABILITY
    peer_tag = "peer-openvino"

    @property
    def peer_how(self) -> str:  # type: ignore[override]
        how = ("what `optimum-cli export openvino` writes for a model of this size (fp32 weights, stateful, "
               "runtime_options KV_CACHE_PRECISION=f16, ACTIVATIONS_SCALE_FACTOR=8.0), decoded by "
               "openvino_genai.LLMPipeline(path, 'CPU') with OpenVINO's defaults (bf16 inference where the CPU has "
               "AVX-512 BF16; the attention backend its default builds, named in the row's notes); held-out loss "
               "from a forward of the same model compiled with the same settings (LLMPipeline returns no logits), "
               "its greedy tokens checked against effkit's loop over that graph")
        if settings.ov_unavailable():
            return how
        return how + "; deviations from the defaults: " + "; ".join(peer_deviations())

    def available(self, device: torch.device | None = None, path: Path | None = None, **options: Any) -> str | None:
        return shared.cpu_only(device, "OpenVINO") or settings.ov_unavailable()

    def load(self, path: Path, device: torch.device) -> OpenVINOCausalLM:
        shared.require_cpu(path, device, self.noun)
        return OpenVINOCausalLM(path)

    def write(self, folder: Path, model: nn.Module, tokenizer, weights: str = "fp32", precision: str = "default",
              workload: str = tune.DEFAULT_WORKLOAD, rule=None, calibrate_on: tuple[Path, str] | None = None,
              bandwidth: bool = False) -> dict[str, Any]:
        """Write `model` into `folder` with its weights stored as `weights` (`compress.WEIGHTS`), gated first
        (`convert.write_artifact`): the one writer of `effkit export --format openvino` and `effkit quantize
        --backend openvino`. `precision`: bf16, f32, "default" (the CPU plug-in's, pinned) or "auto" (written in f32,
        then timed against bf16 at `workload`: `tune.choose_precision`); then LLMPipeline's attention backend chosen
        at `workload` (`tune.record_attention`), each under `rule` (None: `tune.SETTING_BUDGET_S`). `calibrate_on`:
        (the source artifact, its --data) whose training split a data-aware format calibrates on; `bandwidth`: also
        record the weight bytes a token reads and the rate they allow (`compress.bandwidth_bound`). Returns the
        artifact's description as recorded."""
        calibration = None
        if weights in compress.DATA_AWARE and calibrate_on is not None:
            compress.int4_group_size(model, weights)  # a width NNCF cannot group: one line, before the data
            calibration = compress.training_calibration(*calibrate_on)
        desc = convert.write_artifact(folder, model, tokenizer, weights, "f32" if precision == "auto" else precision,
                                      calibration=calibration)
        if precision == "auto":
            picked, how = tune.choose_precision(folder, tokenizer, workload, rule)
            desc.update(inference_precision=picked, precision_how=how["how"], precision_choice=how)
            settings.record(folder, desc)  # the pick travels in the model and the load command
        desc = tune.record_attention(folder, tokenizer, workload, rule)
        if bandwidth:
            desc["weight_bytes_per_token"] = compress.bandwidth_bound(folder)
            settings.record(folder, desc)
        return desc

    def convert(self, folder: Path, source: Path, model: nn.Module, tokenizer, int8: bool = False,
                weights: str | None = None, precision: str = "default", optimize_for: str | None = None,
                **options: Any) -> dict[str, Any]:
        return self.write(folder, model, tokenizer, weights or ("int8" if int8 else "fp32"), precision,
                          optimize_for or tune.DEFAULT_WORKLOAD)

    def exported(self, desc: dict[str, Any], folder: Path, int8: bool) -> tuple[dict[str, Any], dict[str, Any]]:
        return ({"precision": f"weights {desc['weights']}, inference {desc['inference_precision']}",
                 "runtime": desc["runtime"], "exporter": desc["converter"], "weights": desc["weight_types"],
                 "attention": desc.get("attention_how", "")},
                {"max_abs_logit_diff_vs_pytorch": desc["parity"]["max_abs_logit_diff"], "parity": desc["parity"]})

    def write_peer(self, folder: Path, reference: Path, model: nn.Module, tokenizer) -> dict[str, Any]:
        """The reference as optimum-cli writes it, run as its users run it: LLMPipeline with its defaults. Refused
        (EffkitError: the bench says "not run: <reason>") where LLMPipeline cannot run it: never a stand-in decoder
        under its name."""
        desc = convert.write_artifact(folder, model, tokenizer, "fp32", "default", settings.OPTIMUM_RUNTIME_OPTIONS,
                                      peer=True)
        if desc["tokenizer_models"].startswith("not written"):
            raise EffkitError(f"LLMPipeline, which its users run, needs OpenVINO's tokenizer models: "
                              f"{desc['tokenizer_models']}")
        ov_model = OpenVINOCausalLM(folder)
        if ov_model.pipeline(None) is None:
            raise EffkitError(f"openvino_genai.LLMPipeline(path, 'CPU') cannot be built here "
                              f"({ov_model.why_no_pipeline(None)})")
        ran, how = ov_model.default_attention()
        del ov_model
        desc.update(attention_ran=ran, attention_how=how, deviations=peer_deviations())
        (folder / settings.OV_DESC).write_text(json.dumps(desc, indent=2))
        return desc

    def decode(self, model: OpenVINOCausalLM, tokenizer, batch: int, new_tokens: int,
               generate_kwargs: dict[str, Any] | None = None, prompts: list[Any] | None = None):
        """Greedy decoding as OpenVINO's users run it (`tune.decode_timer`: LLMPipeline, its tokens checked)."""
        return tune.decode_timer(model, tokenizer, batch, new_tokens, generate_kwargs, prompts)

    def speculative_target(self, path: Path) -> bool:
        """An artifact of effkit's (not a peer) compiled for f32 inference: its weights, compressed or not, are read
        back per weight, and f32 activations keep a token's logits apart from the other tokens verified beside it
        (bf16's rounding differs between a step of one token and of several)."""
        desc = settings.read_description(path)
        return not desc.get("peer") and desc.get("inference_precision") == "f32"

    def quantized_layers(self, model: nn.Module, path: Path | None = None) -> int:
        desc = getattr(model, "description", {})
        return sum(v for k, v in desc.get("weight_types", {}).items() if k in ("u8", "i8", "u4", "i4"))

    def load_command(self, path: Path) -> str:
        """LLMPipeline with the properties the artifact was timed with that its model file cannot carry (`record`);
        where its tokenizer models are missing, the plain `compile_model` with them (LLMPipeline needs those)."""
        desc = settings.read_description(path)
        props = settings.load_properties(desc)
        if str(desc.get("tokenizer_models", "")).startswith("not written"):
            plain = {k: v for k, v in props.items() if k != "ATTENTION_BACKEND"}
            return f"openvino.Core().compile_model('{Path(path) / settings.OV_MODEL}', 'CPU'" + \
                (f", {plain!r}" if plain else "") + ")"
        from effkit.engines import speculative

        if spec := speculative.read_settings(Path(path)):  # LLMPipeline's own prompt lookup, on paged attention
            props = {**props, "ATTENTION_BACKEND": "PA", "prompt_lookup": True}
        line = f"openvino_genai.LLMPipeline('{path}', 'CPU'" + "".join(f", {k}={v!r}" for k, v in props.items()) + ")"
        if spec:
            line += (f"; greedy at batch 1 with GenerationConfig num_assistant_tokens={spec['k']}, max_ngram_size="
                     f"{speculative.NGRAM_MAX} (the n-gram draft, k measured)")
        return line


ENGINE = OpenVINOEngine()
