"""Model and tokenizer handling for the runtime."""
