"""Text in and out of the model: the tokenizer a GGUF describes, chat templates, and sampling.

- `tokenizer.py`: `Tokenizer.from_metadata(meta)` (byte-level BPE in `bpe.py` with the presets of
  `pretokenize.py`, SentencePiece in `spm.py`) and `StreamDecoder` for streaming output.
- `chat.py`: renders `tokenizer.chat_template` with jinja2 the way Hugging Face does.
- `sampler.py`: logits -> token id (greedy, temperature, top-k/p, min-p, penalties), seeded.

Nothing here knows about devices or the model; the engine sees only token ids.
"""
