"""The GGUF file format and what is read from it: the reader, the block-size table, the model
configuration, the tokenizers and the chat template. Imports nothing of the runtime but errors."""
