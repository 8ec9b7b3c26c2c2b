"""models layer of ksana_llm (see DESIGN.md §1)."""
