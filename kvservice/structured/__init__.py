"""Structured output: grammars that constrain what a request may generate.

`GrammarCompiler` (one per tokenizer and model vocabulary) turns `StructuredOutputParams` into a
cached `CompiledGrammar` and a per-request `GrammarMatcher`; `bitmask` fills and applies the
per-step token masks. The engine is llguidance: it refuses, up front, every schema feature it
cannot enforce, so what it accepts always yields valid output.
"""
