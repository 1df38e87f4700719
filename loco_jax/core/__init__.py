"""The core: the quantizer (Eq. 1, packing), the leaf layout on the wire, and buckets."""
