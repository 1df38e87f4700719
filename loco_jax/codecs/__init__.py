"""Codecs: small floats (fp4/fp8), the GenNorm gradient model, Huffman coding (CO3)."""
