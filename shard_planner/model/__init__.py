"""How a user's model comes in: a model file or a transformers config, and how it is fine-tuned."""
