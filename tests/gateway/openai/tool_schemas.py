"""Function tools the tool-calling tests share."""

from __future__ import annotations

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
# A schema with its own $defs: rebased when the calls' array embeds it.
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "$defs": {"small": {"type": "integer", "minimum": 0, "maximum": 99}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/small"}, "b": {"$ref": "#/$defs/small"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
NO_ARGS = {"type": "function", "function": {"name": "now"}}
