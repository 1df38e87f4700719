"""The host coder CO3's and LoCo's coded exchanges send with: zlib's Huffman-only deflate behind
a checked header (`codecs.huffman_deflate`; why this one: docs/EXPERIMENTS_CO3.md)."""

from loco_jax.codecs import huffman_deflate
from loco_jax.comm import coded

HUFFMAN_DEFLATE = coded.ByteCoder(huffman_deflate.encode, huffman_deflate.decode,
                                  huffman_deflate.overhead)
