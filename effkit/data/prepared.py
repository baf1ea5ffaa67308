"""`prepare(data_cfg)`: the corpus, its tokenizer and the packed blocks of one data section, built once
(the tokenizer and token ids are cached by corpus fingerprint)."""

from __future__ import annotations

from dataclasses import dataclass

from effkit.config import DataConfig
from effkit.data.blocks import BlockData, load_blocks
from effkit.data.corpus import Corpus, load_corpus
from effkit.data.tokenizer import get_tokenizer


@dataclass(frozen=True)
class PreparedData:
    corpus: Corpus
    tokenizer: object  # a transformers fast tokenizer
    tokenizer_source: str  # where the tokenizer came from (trained, cache, a model folder)
    blocks: BlockData


def prepare(cfg: DataConfig, tokenizer_from: str | None = None) -> PreparedData:
    """`tokenizer_from`: a model folder or hub id that brings its own tokenizer (else a BPE is trained)."""
    corpus = load_corpus(cfg.source, cfg.heldout_fraction)
    tokenizer, source = get_tokenizer(corpus, cfg.vocab_size, pretrained=tokenizer_from)
    return PreparedData(corpus, tokenizer, source, load_blocks(corpus, tokenizer, cfg.block_size, cfg.eval_blocks))
