"""CTranslate2 running a CTranslate2 artifact: `Ct2CausalLM`, which runs one through `ctranslate2.Generator` behind
the few methods effkit's measurement code calls on a model (`model(ids).logits`, `generate` with CTranslate2's KV
cache and batching, `config`, `eval`), and its OpenMP thread count, chosen per workload by measurement
(`thread_choices`). Logits (held-out loss, prefill) come from `Generator.forward_batch`; generation from
`generate_batch`, which takes token strings (`tokenizer.convert_ids_to_tokens`)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from effkit.engines.shared import check_length, load_or_fail, stream_after
from effkit.errors import EffkitError
from effkit.measure.engine_model import EngineModel

CT2_DESC = "ctranslate2.json"
HF_CONFIG = "hf_config.json"
PORTABILITY = "portable: plain CTranslate2 loads the folder (ctranslate2.Generator(path))"
THREAD_WORKLOADS = (("decode", 1), ("decode", 12), ("prefill", 12))  # what the thread count is chosen for

def ct2_unavailable(device: torch.device | None = None, compute_type: str | None = None) -> str | None:
    """None if CTranslate2 runs here (on `device`, with `compute_type` if given), else the reason."""
    try:
        import ctranslate2
    except Exception as e:  # noqa: BLE001 - any import failure means: not available
        return f"ctranslate2 does not import ({type(e).__name__}: {str(e)[:100]}); pip install ctranslate2"
    kind = "cuda" if device is not None and device.type == "cuda" else "cpu"
    try:
        supported = ctranslate2.get_supported_compute_types(kind)
    except Exception as e:  # noqa: BLE001 - a CPU-only build asked about CUDA
        return f"this CTranslate2 build cannot run on {kind} ({type(e).__name__}: {str(e)[:80]})"
    if compute_type is not None and compute_type not in supported:
        return (f"compute type {compute_type} is not supported on this {kind} (supported here: "
                f"{', '.join(sorted(supported))})")
    return None


def settle_after(threads: int, device_type: str) -> float:
    """The same settle rule as every engine's: a contender whose runtime keeps a pool of spin-waiting CPU threads
    after a call (ONNX Runtime's sessions; CTranslate2's OpenMP threads when it runs more than one) leaves the
    machine idle for `timing.SETTLE_S` after it is timed; one that runs on the calling thread needs none."""
    from effkit.measure.timing import SETTLE_S

    return SETTLE_S if device_type == "cpu" and threads > 1 else 0.0


def model_id(path: Path) -> str:
    """`model 3f2a9c01d4e5 (124439808 params)`: which model a thread choice was measured on, by its shapes (a
    digest of its config and parameter count): a pruned model is another model, and never reuses the dense one's
    samples; two trainings of one shape cost the same and share it."""
    import hashlib

    params = int(json.loads((Path(path) / CT2_DESC).read_text()).get("params", 0))
    digest = hashlib.sha256((Path(path) / HF_CONFIG).read_bytes() + str(params).encode()).hexdigest()[:12]
    return f"model {digest} ({params} params)"


def threads_key(compute_type: str, path: Path) -> str:
    """The machine cache's key of a thread choice: CPU, threads, CTranslate2's version, compute type, the rule's
    version and the model (`model_id`)."""
    import ctranslate2

    from effkit.measure import choice, hardware

    return (f"{hardware.describe_device(torch.device('cpu'))}|threads {torch.get_num_threads()}|ctranslate2 "
            f"{ctranslate2.__version__}|{compute_type}|per workload|{choice.RULE_VERSION}|{model_id(path)}")


def thread_choices(path: Path, compute_type: str, device_type: str, start: list[str],
                   n_positions: int = 128) -> dict[str, dict[str, Any]]:
    """CTranslate2's OpenMP threads for this machine, chosen per workload by measurement, never assumed (more
    threads can decode far slower than one on a small machine, and their waiting threads slow every model timed
    beside them; batch 12 and a prefill may differ). For decode at batch 1 and 12 (32 greedy tokens from the token
    strings `start`) and prefill at batch 12, one thread and torch's thread count go through the decision rule
    (`effkit.measure.choice`; a tie within the precision goes to one thread). Cached per machine (host and CPU
    flags), thread count, CTranslate2 version, compute type, rule and model (`model_id`: its config and size), with
    the date and every sample: `{"decode_b1": {"threads": 1, "verdict": ..., "ratio": <the other vs
    it>, "choice": {...}}, ...}`."""
    import ctranslate2

    from effkit.measure import choice, machine_cache

    most = torch.get_num_threads()
    keys = [f"{kind}_b{batch}" for kind, batch in THREAD_WORKLOADS]
    if device_type != "cpu" or most <= 1:
        return {k: {"threads": max(most, 1), "how": "torch's thread count (nothing to choose)"} for k in keys}
    key = threads_key(compute_type, path)
    rule = choice.Rule(budget_s=10.0)

    def measure() -> dict[str, Any]:
        generators = {n: ctranslate2.Generator(str(path), device="cpu", compute_type=compute_type, intra_threads=n)
                      for n in (1, most)}
        block = min(128, n_positions)
        ids = ctranslate2.StorageView.from_array(np.ones((12, block), np.int32))
        lengths = ctranslate2.StorageView.from_array(np.full(12, block, np.int32))

        def timer(g, kind: str, batch: int):
            def once() -> float:
                t = time.perf_counter()
                if kind == "decode":
                    g.generate_batch([start] * batch, max_length=32, min_length=32, include_prompt_in_result=False,
                                     end_token=[])
                    return 32 * batch / (time.perf_counter() - t)
                g.forward_batch(ids, lengths)
                return time.perf_counter() - t
            return once

        out = {}
        for kind, batch in THREAD_WORKLOADS:
            fns = {str(n): timer(g, kind, batch) for n, g in generators.items()}
            for n, fn in fns.items():
                fn.settle_s = settle_after(int(n), "cpu")
            # a tie goes to one thread: its threads do not spin and slow whatever runs beside it
            c = choice.choose(fns, kind == "decode", rule, prefer=int)
            out[f"{kind}_b{batch}"] = {"threads": int(c.picked), "verdict": c.label,
                                       "vs": (vs := "1" if c.picked != "1" else str(most)),
                                       "ratio": c.ratios.get(vs, {"ratio": math.nan, "ci": [math.nan, math.nan],
                                                                  "verdict": "invalid"}),
                                       "rounds": max(c.record["rounds"].values()), "choice": c.to_dict()}
        return out

    chosen, _ = machine_cache.machine_cached("ct2_threads", key, measure)
    note = f"{machine_cache.cache_note('ct2_threads', key)}, for {model_id(path)}"
    from effkit.measure.results import PairedRatio

    return {k: {**v, "how": f"{v['threads']} thread(s), {v['verdict']}: {v['vs']} thread(s) vs it "
                            f"{PairedRatio.of(v['ratio']).fmt()} over {v['rounds']} paired rounds; {note}"}
            for k, v in chosen.items()}


class Ct2CausalLM(EngineModel):
    """A CTranslate2 artifact behind effkit's model interface. It holds no PyTorch parameters: `n_params` is
    the source's parameter count."""

    compilable = False  # CTranslate2 runs its own kernels

    def __init__(self, path: str | Path, device: torch.device | None = None):
        super().__init__()
        import ctranslate2
        from transformers import GPT2Config

        from effkit.data.tokenizer import saved_tokenizer

        path = Path(path)
        if reason := ct2_unavailable(device):
            raise EffkitError(f"{path} is a CTranslate2 artifact, which cannot run here: {reason}")
        try:
            self.description = json.loads((path / CT2_DESC).read_text())
            self.config = GPT2Config.from_dict(json.loads((path / HF_CONFIG).read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError, OSError) as e:
            raise EffkitError(f"{path} is not a complete CTranslate2 artifact ({type(e).__name__}); write it again") \
                from None
        compute_type = self.description["compute_type"]
        if reason := ct2_unavailable(device, compute_type):
            raise EffkitError(f"{path} computes in {compute_type}: {reason}")
        self.tokenizer = saved_tokenizer(path)
        self.device_type = "cuda" if device is not None and device.type == "cuda" else "cpu"
        start = self.tokenizer.convert_ids_to_tokens(self.tokenizer("The state of the Union").input_ids)
        torch_threads = torch.get_num_threads()
        try:
            with load_or_fail(f"CTranslate2 cannot open {path}", "write it again"):  # a truncated or foreign folder
                self.thread_choices = thread_choices(path, compute_type, self.device_type, start,
                                                     self.config.n_positions)
                self.generation_note = "CTranslate2 intra_threads per workload: " + "; ".join(
                    f"{k.replace('_', ' ')} {v['threads']} ({v['how']})" for k, v in self.thread_choices.items())
                self.generators = {n: ctranslate2.Generator(str(path), device=self.device_type,
                                                            compute_type=compute_type, intra_threads=n)
                                   for n in sorted({v["threads"] for v in self.thread_choices.values()})}
        finally:
            # CTranslate2 sets the OpenMP thread count of the calling thread, which is PyTorch's too: put it back,
            # or every PyTorch model in the process would run on CTranslate2's thread count
            torch.set_num_threads(torch_threads)
        self.n_params = int(self.description.get("params", 0))
        self.path = path
        self.threads = max(self.generators)
        self.settle_s = settle_after(self.threads, self.device_type)

    def generator_for(self, kind: str, batch: int):
        """The generator with the thread count measured best for this workload (the nearest measured batch)."""
        measured = [(k, b) for k, b in THREAD_WORKLOADS if k == kind] or list(THREAD_WORKLOADS)
        k, b = min(measured, key=lambda kb: abs(kb[1] - batch))
        return self.generators[self.thread_choices[f"{k}_b{b}"]["threads"]]

    def forward(self, input_ids: torch.Tensor, **_: Any) -> SimpleNamespace:
        import ctranslate2

        check_length(input_ids.shape[-1], self.config.n_positions)
        ids = np.ascontiguousarray(input_ids.detach().cpu().numpy().astype(np.int32))
        lengths = np.full(ids.shape[0], ids.shape[1], np.int32)
        out = self.generator_for("prefill", ids.shape[0]).forward_batch(ctranslate2.StorageView.from_array(ids),
                                                                         ctranslate2.StorageView.from_array(lengths))
        if self.device_type == "cuda":
            return SimpleNamespace(logits=torch.as_tensor(out, device="cuda").float())
        return SimpleNamespace(logits=torch.from_numpy(np.array(out)).float())

    @torch.inference_mode()
    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False, top_k: int | None = None,
                 temperature: float = 1.0, streamer=None, min_new_tokens: int = 0, **_: Any) -> torch.Tensor:
        """Exactly `max_new_tokens` new tokens (nothing stops it early); with `min_new_tokens`, end-of-text is
        CTranslate2's end token and `min_length` keeps it from being picked before then, as transformers'
        `min_new_tokens` does for PyTorch (so the texts, not only the token counts, match); sampling is seeded from
        torch's global generator."""
        ids = input_ids.cpu().long()
        check_length(ids.shape[1], self.config.n_positions, max_new_tokens)
        starts = [self.tokenizer.convert_ids_to_tokens(row) for row in ids.tolist()]
        kwargs: dict[str, Any] = {"sampling_topk": 1}
        if do_sample:
            import ctranslate2

            ctranslate2.set_random_seed(int(torch.randint(0, 2**31 - 1, (1,))))
            kwargs = {"sampling_topk": top_k or 0, "sampling_temperature": max(temperature, 1e-6)}
        eos = self.tokenizer.eos_token
        if min_new_tokens and eos is not None:  # suppressed until min_length; min = max here: never picked
            kwargs |= {"end_token": eos, "min_length": max(min_new_tokens, max_new_tokens)}
        else:  # no end token: nothing stops decoding, and end-of-text is a token like any other
            kwargs |= {"end_token": [], "min_length": max_new_tokens}
        results = self.generator_for("decode", len(starts)).generate_batch(
            starts, max_length=max_new_tokens, include_prompt_in_result=False, **kwargs)
        new = torch.tensor([r.sequences_ids[0] for r in results], dtype=torch.long)
        stream_after(streamer, ids, new)  # CTranslate2 generates the batch at once: the text is streamed after
        return torch.cat([ids, new], dim=1)
