"""The model's pieces beside model.py: GPT-2's tokenizer, the token shards and their loader, the loss, and generation."""
