"""Tool calling: the plan from `tools`/`tool_choice`, the prompt, the parsers, the stream."""
