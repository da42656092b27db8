"""Models and tokenizers from disk: presets, HF directories and GGUF files.

Reads configs and weights (GGUF dequantized at load), builds the tokenizer (HF
`tokenizer.json` or a GGUF's own vocabulary) and renders chat templates. Nothing is
downloaded. Imports the model room to build the model; knows nothing of engines or connectors.
"""
