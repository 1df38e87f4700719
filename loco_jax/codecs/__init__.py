"""Codecs the library runs: small floats (fp4/fp8), the GenNorm gradient model, the wire coder."""
