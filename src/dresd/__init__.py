"""dresd: lossless speculative decoding by dense retrieval (DReSD), with its peers beside it."""

__version__ = "0.1.0"
