"""Entry points into other libraries: the HuggingFace Trainer line, transformers compatibility, model discovery."""
