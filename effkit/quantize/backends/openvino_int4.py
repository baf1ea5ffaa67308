"""`openvino-int4`: the `openvino` backend with NNCF's 4-bit weights, so that `auto` judges OpenVINO's int4 beside
the int8 backends and ONNX Runtime's MatMulNBits. Batch-1 decoding reads every weight once per token: on the `gpt2`
shape (92M parameters, trained) on a Zen 4 EPYC, int4 in groups of 128 read 50.6 MB a token against 91.5 MB for ONNX
Runtime's int8 and decoded 1.55x as fast at batch 1 and 1.28x at batch 12 (OpenVINO's CPU plug-in quantizes the
activations of int4 matmuls to int8 on the fly) at +0.01% held-out loss (docs/benchmarks.md, session 21).

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
