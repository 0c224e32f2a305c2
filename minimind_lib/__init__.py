"""minimind_lib: the small library the MiniMind course imports (tokenizer, data, model, training)."""

__version__ = "0.1.0"
