"""Data: corpora, tokenizer, block packing and loaders; `prepare(data_cfg)` builds them all."""

from effkit.data.blocks import BlockData, BlockSampler, load_blocks, make_loader
from effkit.data.corpus import Corpus, load_corpus
from effkit.data.prepared import PreparedData, prepare
from effkit.data.tokenizer import cache_dir, get_tokenizer

__all__ = ["BlockData", "BlockSampler", "Corpus", "PreparedData", "load_blocks", "load_corpus", "make_loader",
           "get_tokenizer", "cache_dir", "prepare"]
