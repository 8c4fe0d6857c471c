"""Engram addressing: compressed vocabulary, layouts and the row addresser."""

from cachelab.engram.addresser import Addresser, AddressStream
from cachelab.engram.config import PRESETS, EngramConfig, get_preset
from cachelab.engram.vocab import compressed_map, encode, load_tokenizer

__all__ = ["Addresser", "AddressStream", "EngramConfig", "PRESETS", "get_preset",
           "compressed_map", "encode", "load_tokenizer"]
