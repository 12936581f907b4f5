"""Other formats' weights and states: Hugging Face models and tokenizers, the shared files, whole training states."""
