"""Quantization: the backend registry (`effkit.quantize.backends`, one module per backend) and the
`effkit quantize` stage (`effkit.quantize.stage`). Importing this package imports neither."""
