"""Structured output (JSON schema, regex, EBNF grammars) on top of `xgrammar`.

A leaf package: it imports xgrammar, torch and `ksana_llm.generation_config` only. The engine
compiles a request's `StructuredOutputSpec` once at submit (so a bad schema fails in the caller),
gives the sequence a `GrammarMatcher`, masks each step's logits with the matcher's bitmask and
feeds every sampled token back to it.
"""

from ksana_llm.structured.bitmask import allocate_bitmask, apply_bitmask
from ksana_llm.structured.grammar import STRUCTURED_OUTPUT_KINDS, GrammarCompiler, GrammarMatcher

__all__ = ["STRUCTURED_OUTPUT_KINDS", "GrammarCompiler", "GrammarMatcher", "allocate_bitmask",
           "apply_bitmask"]
