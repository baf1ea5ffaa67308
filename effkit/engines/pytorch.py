"""PyTorch: effkit's own artifacts (dense, pruned: plain Hugging Face folders) and quantized ones, which their
backend (`effkit.registry.BACKENDS`, named in `quantization.json`) rebuilds as a PyTorch model.

A target paired with a draft (`with_draft`: a smaller model of the same vocabulary, `effkit prune --mode draft`)
decodes through transformers' assisted generation: the draft proposes k tokens, the target checks them in one
forward, and greedy output is the target's own token for token (`Assisted`)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from effkit.artifacts import read_meta
from effkit.artifacts.quantized import description, is_quantized
from effkit.engines import Engine
from effkit.errors import EffkitError
from effkit.registry import BACKENDS


class PyTorchEngine(Engine):
    name = "pytorch"
    marker = ""  # owns every folder no other engine claims
    label = "PyTorch"
    noun = "a PyTorch"  # "is a PyTorch artifact"
    summary = "PyTorch (transformers' GPT-2; quantized artifacts through their backend)"
    # a prefill as decoding runs it: the forward builds the KV cache, as ONNX Runtime's with-past graph does (its
    # presents are outputs)
    prefill_kwargs = {"use_cache": True}
    trains = True

    def owns(self, path: str | Path) -> bool:
        return False

    def _backend(self, path: Path):
        return BACKENDS.get(description(path)["backend"])

    def available(self, device: Any = None, path: Path | None = None, **options: Any) -> str | None:
        if path is None or not is_quantized(path):
            return None
        try:
            backend = description(path)["backend"]
        except (EffkitError, OSError):
            return None  # loading it says what is wrong
        if backend not in BACKENDS:
            return f"unknown backend {backend}"
        return BACKENDS.get(backend).available(device)

    def load(self, path: Path, device: Any):
        if is_quantized(path):
            desc = description(path)
            if reason := self.available(device, path):
                raise EffkitError(f"{path} was quantized with {desc['backend']}, which cannot run here: {reason}")
            return self._backend(path).load(Path(path), desc, device)
        from effkit.model import load_model

        return load_model(str(path)).to(device)

    def quantized_layers(self, model: Any, path: Path | None = None) -> int:
        return self._backend(path).quantized_layers(model) if path is not None and is_quantized(path) else 0

    def load_command(self, path: Path) -> str:
        if is_quantized(path):
            return self._backend(path).load_command(path)
        return f"AutoModelForCausalLM.from_pretrained('{path}')"

    def with_draft(self, target: Path, draft: Path, device: Any, k: int | None = None) -> Assisted:
        """The target at `target` decoding with the draft at `draft`, `k` tokens per step (default: the k the
        draft's acceptance was measured with, else `DEFAULT_K`); a draft of another vocabulary is refused."""
        check_vocabulary(target, draft)
        k = k or (read_meta(Path(draft)).get("metrics", {}).get(DRAFT) or {}).get("k", DEFAULT_K)
        return Assisted(self.load(Path(target), device), self.load(Path(draft), device), k)


DRAFT = "draft"  # the key of a draft's record among its artifact's metrics (`effkit.prune.draft`)
DEFAULT_K = 4


def check_vocabulary(target: str | Path, draft: str | Path) -> None:
    """Refuse, in one line, a draft whose tokenizer (vocabulary) is not the target's: its token ids would mean
    other text, and the target could accept none of its tokens."""
    from transformers import AutoConfig, AutoTokenizer

    try:
        sizes = [AutoConfig.from_pretrained(str(p)).vocab_size for p in (target, draft)]
        vocabs = [AutoTokenizer.from_pretrained(str(p)).get_vocab() for p in (target, draft)]
    except (OSError, ValueError) as e:
        raise EffkitError(f"cannot read the model or tokenizer of {target} or {draft}: {e}") from None
    if sizes[0] != sizes[1] or vocabs[0] != vocabs[1]:
        raise EffkitError(f"the draft {draft} has another tokenizer than the target {target} ({len(vocabs[1])} "
                          f"tokens, model vocabulary {sizes[1]}, against {len(vocabs[0])} and {sizes[0]}); a draft "
                          "must share its target's vocabulary: make one with effkit prune --mode draft")


class Assisted:
    """A target model whose `generate` runs transformers' assisted generation with `draft` proposing exactly `k`
    tokens per step (`num_assistant_tokens`, constant schedule, no confidence cut: transformers reads them from the
    draft's generation config); everything else is the target's. Assisted generation decodes one sequence at a
    time, so a batch is decoded row by row (padded to the longest)."""

    def __init__(self, target: Any, draft: Any, k: int):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise EffkitError(f"draft tokens per step (k) must be a whole number, 1 or more (got {k!r})")
        config = copy.deepcopy(draft.generation_config)
        config.num_assistant_tokens, config.num_assistant_tokens_schedule = k, "constant"
        config.assistant_confidence_threshold = 0.0
        draft.generation_config = config
        self.target, self.draft, self.k = target, draft, k

    def __getattr__(self, name: str) -> Any:
        if name in ("target", "draft", "k"):  # not set yet (copying, unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.target, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.target(*args, **kwargs)

    def eval(self) -> Assisted:
        self.target.eval(), self.draft.eval()
        return self

    def to(self, *args: Any, **kwargs: Any) -> Assisted:
        self.target, self.draft = self.target.to(*args, **kwargs), self.draft.to(*args, **kwargs)
        return self

    def generate(self, input_ids, attention_mask=None, **kwargs: Any):
        import torch

        rows = []
        for i in range(input_ids.shape[0]):
            mask = None if attention_mask is None else attention_mask[i:i + 1]
            rows.append(self.target.generate(input_ids[i:i + 1], attention_mask=mask, assistant_model=self.draft,
                                             **kwargs)[0])
        if len(rows) == 1:
            return rows[0][None]
        pad = kwargs.get("pad_token_id")
        pad = self.target.generation_config.pad_token_id if pad is None else pad
        return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=pad or 0)


ENGINE = PyTorchEngine()
