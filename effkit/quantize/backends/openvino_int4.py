"""`openvino-int4`: the `openvino` backend with NNCF's 4-bit weights, so that `auto` judges OpenVINO's int4 beside
the int8 backends and ONNX Runtime's MatMulNBits. Batch-1 decoding reads every weight once per token, and int4 reads
about half the bytes int8 does (OpenVINO's CPU plug-in quantizes the activations of int4 matmuls to int8 on the fly);
what it gained and cost on a trained model: docs/benchmarks.md.

Its weights: `int4` (symmetric, groups of 128, data-free: NNCF's INT4_SYM), or `int4-data` where `--weight-format`
asks for it (AWQ and scale estimation calibrated on training blocks; see `openvino`); `--weight-format int8`, the
shared option's default, means `int4` here. The token embedding and LM head stay in NNCF's int8 backup, as NNCF
writes them. Everything else (inference precision, attention backend, the folder, how it loads) is `openvino`'s."""

from __future__ import annotations

from effkit.quantize.backends.openvino import OpenVINO


class OpenVINOInt4(OpenVINO):
    name = "openvino-int4"
    summary = "OpenVINO with NNCF int4 weights (groups of 128; --weight-format int4-data: AWQ + scale estimation)"

    def weights(self, cfg) -> str:
        return "int4-data" if cfg.options.weight_format == "int4-data" else "int4"


BACKEND = OpenVINOInt4()
