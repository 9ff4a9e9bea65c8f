"""Training data that needs no download: byte-level text from the Python standard library's own source."""

from lightning_nnscaler.data.stdlib_text import ByteWindows, TextSplits, decode, encode, load_stdlib_text, stdlib_files

__all__ = ["ByteWindows", "TextSplits", "decode", "encode", "load_stdlib_text", "stdlib_files"]
