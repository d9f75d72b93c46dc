"""The programs and the driver over the cache: backends, the jit boundary, sizing, the Engine, speculative
decoding, the prefix index, checkpoints, tensor parallelism."""
