"""OpenVINO weight compression, NNCF's: int8 and int4 data-free, or int4-data, NNCF's data-aware int4 (AWQ and
scale estimation) calibrated on blocks of the run's training split (`training_calibration`: evenly spaced training
blocks, each run through the stateful graph as a fresh prompt, `calibration_inputs`); both int4 forms in groups of
the largest of 128, 64, 32 that divides every int4 matrix's rows (`int4_group_size`). `openvino.json` records under
`weight_compression` the mode, group size, ratio, the algorithms asked and what AWQ changed (NNCF's AWQ patterns
match no layer of GPT-2's graph: it is asked, and recorded as having changed none), the calibration blocks' split,
count and indices, and the NNCF version. Also what a compressed IR costs a decoded token: the weight bytes it reads
(`weight_bytes_per_token`) and the rate the memory bandwidth allows them (`bandwidth_bound`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from effkit.engines.decoder_step import quiet_exporter
from effkit.engines.openvino.settings import OV_MODEL
from effkit.errors import EffkitError

# what NNCF stores the matrices in (int8: asymmetric per channel, as optimum; int4: data-free; int4-data: AWQ and
# scale estimation calibrated on training blocks, `compress`)
WEIGHTS = ("fp32", "int8", "int4", "int4-data")
DATA_AWARE = frozenset({"int4-data"})  # the weight formats calibrated on the run's training split
INT4_GROUPS = (128, 64, 32)  # int4-data's group size: the first that divides every int4 matrix's rows
CALIBRATION_BLOCKS = 64  # training blocks int4-data calibrates on (NNCF's subset_size)
LOOKUP_CHAIN = ("Convert", "Subtract", "Multiply", "Reshape")  # a compressed table's dequantization on its way


def nncf_unavailable() -> str | None:
    """None if NNCF, which compresses the weights, imports here, else the reason in one line."""
    try:
        import nncf  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"nncf does not import ({type(e).__name__}: {str(e)[:80]}); pip install 'effkit[quant]'"
    return None


def int4_group_size(model: nn.Module, weights: str = "int4-data") -> int:
    """The int4 group size for `model`: the largest of INT4_GROUPS that divides the input width of every matrix NNCF
    stores in int4 (every linear layer but the LM head; the embeddings and the head stay int8), since NNCF refuses a
    group that does not divide a row. None of them dividing: one line naming the widths and the fix."""
    widths = set()
    for name, m in model.named_modules():
        if name.split(".")[-1] == "lm_head":
            continue
        if isinstance(m, nn.Linear):
            widths.add(m.in_features)
        elif type(m).__name__ == "Conv1D":  # Hugging Face's GPT-2 layout: weight (in, out)
            widths.add(int(m.weight.shape[0]))
    for g in INT4_GROUPS:
        if all(w % g == 0 for w in widths):
            return g
    odd = sorted(w for w in widths if w % INT4_GROUPS[-1])
    raise EffkitError(f"--weight-format {weights}: NNCF's int4 groups of {'/'.join(map(str, INT4_GROUPS))} divide no "
                      f"row of this model's matrices of width {', '.join(map(str, odd))}; prune with "
                      f"--width-multiple {INT4_GROUPS[-1]}, or use --weight-format int8")


def calibration_blocks(train: torch.Tensor, n: int = CALIBRATION_BLOCKS) -> tuple[np.ndarray, list[int]]:
    """`n` blocks of the training split `train` ((blocks, block_size) token ids), evenly spaced over it (all of
    them where it has fewer): the data-aware compression's calibration set, never a held-out block. Returns (the
    blocks as int64, their indices in `train`)."""
    total = int(train.shape[0])
    idx = sorted({int(i) for i in np.linspace(0, total - 1, min(n, total)).round()})
    return train[idx].numpy().astype(np.int64), idx


def calibration_inputs(block: np.ndarray) -> dict[str, np.ndarray]:
    """One calibration block as the stateful graph's inputs (a fresh state: NNCF resets it before each item): the
    whole block as the prompt, batch 1, every position attended."""
    n = int(block.shape[-1])
    return {"input_ids": block.reshape(1, n).astype(np.int64), "attention_mask": np.ones((1, n), np.int64),
            "position_ids": np.arange(n, dtype=np.int64)[None], "beam_idx": np.zeros(1, np.int32)}



def training_calibration(source: Path, data: str = "") -> tuple[np.ndarray, dict[str, Any]]:
    """The data-aware formats' calibration set: `CALIBRATION_BLOCKS` blocks of the TRAINING split of the data the
    stage reads (the artifact's data section, its corpus replaced by `data` where given, through its tokenizer: the
    split whose other part, the held-out blocks, measures the artifact), evenly spaced over it
    (`calibration_blocks`). Returns (the blocks, what `openvino.json` records of them)."""
    from effkit import artifacts
    from effkit.config import DataConfig
    from effkit.data import prepare

    section = artifacts.data_section(source, data)
    prepared = prepare(DataConfig.from_dict(section), tokenizer_from=str(source))
    train = prepared.blocks.train
    blocks, idx = calibration_blocks(train)
    return blocks, {"split": "train", "sequences": len(idx), "tokens_each": int(train.shape[1]),
                    "of_train_blocks": int(train.shape[0]), "indices": idx, "data": section.get("source"),
                    "how": f"{len(idx)} blocks of {int(train.shape[1])} tokens evenly spaced over the "
                           f"{int(train.shape[0])} training blocks of the run's data (its held-out blocks, which "
                           f"measure the artifact, never used), each a fresh sequence from position 0"}


def compress(om, weights: str, calibration: np.ndarray | None = None, group_size: int = 128) -> dict[str, Any]:
    """NNCF's weight compression of `om` in place. int8: asymmetric per output channel (optimum-cli's
    `--weight-format int8`), data-free. int4: symmetric in groups of `group_size` (128, or 64 / 32 where 128 does
    not divide a matrix's rows: `int4_group_size`) with the embedding / head in int8 (NNCF's defaults for int4),
    data-free. int4-data: NNCF's data-aware int4: asymmetric (the mode OpenVINO's
    documentation gives for accuracy over speed, and optimum-cli's int4 default) in groups of `group_size`, every
    layer but the embedding / head in int4 (ratio 1.0), AWQ and scale estimation calibrated on the `calibration`
    blocks ((n, block_size) token ids of the training split: `calibration_blocks`). Returns what was done:
    `compression` (a line), `nncf` (its version), `weight_compression` (mode, group size, ratio, the algorithms and
    the scales AWQ inserted)."""
    import logging

    import nncf

    if weights == "int8":
        mode, how = nncf.CompressWeightsMode.INT8_ASYM, "nncf.compress_weights(mode=INT8_ASYM): int8 per channel"
        kwargs: dict[str, Any] = {}
        record: dict[str, Any] = {"mode": "INT8_ASYM", "group_size": None, "ratio": None, "data": None}
    elif weights == "int4":
        mode, how = nncf.CompressWeightsMode.INT4_SYM, (f"nncf.compress_weights(mode=INT4_SYM, group_size="
                                                        f"{group_size}, ratio=1.0): int4 in groups of {group_size}, "
                                                        "data-free")
        kwargs = {"group_size": group_size, "ratio": 1.0}
        record = {"mode": "INT4_SYM", "group_size": group_size, "ratio": 1.0, "awq": False, "scale_estimation": False,
                  "data": None}
    elif weights == "int4-data":
        if calibration is None or not len(calibration):
            raise EffkitError("--weight-format int4-data needs calibration blocks of the training split")
        mode = nncf.CompressWeightsMode.INT4_ASYM
        kwargs = {"group_size": group_size, "ratio": 1.0, "awq": True, "scale_estimation": True,
                  "dataset": nncf.Dataset(list(calibration), calibration_inputs), "subset_size": len(calibration)}
        how = (f"nncf.compress_weights(mode=INT4_ASYM, group_size={group_size}, ratio=1.0, awq=True, "
               f"scale_estimation=True, dataset=<{len(calibration)} training blocks of {calibration.shape[1]} "
               f"tokens>): int4 in groups of {group_size}, data-aware")
        record = {"mode": "INT4_ASYM", "group_size": group_size, "ratio": 1.0, "awq": True, "scale_estimation": True}
    else:
        raise EffkitError(f"unknown OpenVINO weight format {weights!r}; choose one of {', '.join(WEIGHTS[1:])}")
    record["backup"] = "INT8_ASYM per channel: the token and position embeddings and the LM head (NNCF's default)" \
        if weights != "int8" else None
    logging.getLogger("nncf").setLevel(logging.ERROR)
    try:
        with quiet_exporter():  # NNCF draws a progress bar on stdout
            nncf.compress_weights(om, mode=mode, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise EffkitError(f"NNCF could not compress this model's weights to {weights}: {type(e).__name__}: "
                          f"{' '.join(str(e).split())[:200]}") from None
    if weights == "int4-data":
        # AWQ scales a layer's input channels through a Multiply it inserts after the op feeding it; NNCF 3.4 matches
        # only a MatMul fed by a Multiply or by one of its "atomic" activations (ReLU, SiLU, sigmoid...; not Gelu),
        # and says it skipped AWQ only in its log
        smoothed = sorted(op.get_friendly_name() for op in om.get_ops() if op.get_friendly_name().endswith("/awq_mul"))
        record["awq_scales"] = len(smoothed)  # the Multiply nodes AWQ inserted (one per op feeding smoothed layers)
        if not smoothed:
            record["awq_note"] = ("asked, changed no layer: NNCF's AWQ patterns (a MatMul fed by a Multiply or by an "
                                  "activation among ReLU, SiLU, sigmoid..., Gelu not among them) match no layer of "
                                  "this graph (GPT-2's MLP down-projection follows a Gelu, its other matrices a "
                                  "LayerNorm or the attention)")
    return {"compression": how, "nncf": nncf.__version__, "weight_compression": record}


def weight_types(om) -> dict[str, int]:
    """The model's weight constants (rank >= 2) counted by element type: what the file really stores."""
    counts: dict[str, int] = {}
    for op in om.get_ops():
        if op.get_type_name() == "Constant" and len(op.get_output_partial_shape(0)) >= 2:
            shape = op.get_output_shape(0)
            if int(np.prod(shape)) >= 256:
                t = op.get_output_element_type(0).get_type_name()
                counts[t] = counts.get(t, 0) + 1
    return counts



def weight_bytes_per_token(folder: Path) -> dict[str, Any]:
    """Bytes of the IR's constants one decoded token reads at batch 1: every constant in full, but of a table that is
    only looked up (a Gather, through its dequantization: the token and position embeddings) one row. A constant
    the file stores once for two uses (the tied embedding / LM head: the head reads all of it) counts once, as the
    head. The KV cache, which grows with the context, is not a weight and is left out."""
    import openvino as ov

    om = ov.Core().read_model(str(folder / OV_MODEL))

    def consumers(node) -> list:
        return [t.get_node() for o in node.outputs() for t in o.get_target_inputs()]

    def only_looked_up(node, depth: int = 0) -> bool:
        users = consumers(node)
        return bool(users) and all(
            u.get_type_name() == "Gather" or (u.get_type_name() in LOOKUP_CHAIN and depth < 6
                                              and only_looked_up(u, depth + 1)) for u in users)

    full = rows = 0
    for n in om.get_ordered_ops():
        if n.get_type_name() != "Constant":
            continue
        size, shape = int(n.get_byte_size()), list(n.get_output_shape(0))
        if len(shape) >= 2 and shape[0] > 0 and only_looked_up(n):
            rows += size // shape[0]
        else:
            full += size
    return {"bytes_per_token": full + rows, "looked_up_rows_bytes": rows,
            "file_bytes": int((folder / OV_MODEL).with_suffix(".bin").stat().st_size),
            "how": "every constant of the IR in full, but one row of each table only looked up (Gather, through its "
                   "dequantization); the tied table counted once, as the LM head; the KV cache not counted"}


def bandwidth_bound(folder: Path) -> dict[str, Any]:
    """The weight bytes a decoded token reads (`weight_bytes_per_token`) and the batch-1 decoding rate the memory
    bandwidth, measured now, would allow them."""
    from effkit.measure import roofline

    per_token = weight_bytes_per_token(folder)
    bandwidth, how = roofline.memory_bandwidth()
    return {**per_token, "memory_bandwidth_bytes_per_s": bandwidth, "memory_bandwidth_how": how,
            "bandwidth_bound_tokens_per_s": bandwidth / per_token["bytes_per_token"]}
