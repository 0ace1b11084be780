"""Thirty-five JSON schemas for guided decoding tests: nested objects, bounded arrays, enums,
number bounds, string patterns and lengths, required and optional fields, anyOf, $defs/$ref,
additionalProperties false. Bounds keep a random-weight model's outputs short."""

from __future__ import annotations

from typing import Any

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat_required": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "optional_fields": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "nickname": {"type": "string", "maxLength": 8},
            "active": {"type": "boolean"},
        },
        "required": ["id"],
    },
    "nested_two": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "first": {"type": "string", "maxLength": 10},
                    "last": {"type": "string", "maxLength": 10},
                },
                "required": ["first", "last"],
                "additionalProperties": False,
            }
        },
        "required": ["user"],
        "additionalProperties": False,
    },
    "nested_three": {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {
                    "b": {
                        "type": "object",
                        "properties": {"c": {"type": "integer", "minimum": 0, "maximum": 9}},
                        "required": ["c"],
                    }
                },
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    "int_array_bounded": {
        "type": "object",
        "properties": {
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": 100},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        "required": ["scores"],
    },
    "string_array_bounded": {
        "type": "array",
        "items": {"type": "string", "minLength": 1, "maxLength": 6},
        "minItems": 2,
        "maxItems": 4,
    },
    "enum_strings": {
        "type": "object",
        "properties": {"color": {"enum": ["red", "green", "blue"]}},
        "required": ["color"],
    },
    "enum_mixed": {
        "type": "object",
        "properties": {"v": {"enum": ["auto", 0, 1, None, True]}},
        "required": ["v"],
    },
    "const_value": {
        "type": "object",
        "properties": {
            "version": {"const": "v1"},
            "n": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["version", "n"],
    },
    "integer_bounds": {
        "type": "object",
        "properties": {
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "month": {"type": "integer", "minimum": 1, "maximum": 12},
        },
        "required": ["year", "month"],
    },
    "integer_exclusive": {
        "type": "object",
        "properties": {"x": {"type": "integer", "exclusiveMinimum": -5, "exclusiveMaximum": 5}},
        "required": ["x"],
    },
    "negative_range": {"type": "integer", "minimum": -1000, "maximum": -10},
    "number_bounds": {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0.5, "maximum": 99.5}},
        "required": ["price"],
    },
    "number_free": {
        "type": "object",
        "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
        "required": ["lat", "lon"],
    },
    "multiple_of": {
        "type": "object",
        "properties": {
            "dozen": {"type": "integer", "multipleOf": 12, "minimum": 0, "maximum": 120}
        },
        "required": ["dozen"],
    },
    "boolean_and_null": {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "nothing": {"type": "null"}},
        "required": ["ok", "nothing"],
    },
    "nullable_type_list": {
        "type": "object",
        "properties": {"note": {"type": ["string", "null"], "maxLength": 12}},
        "required": ["note"],
    },
    "string_pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
    },
    "string_lengths": {
        "type": "object",
        "properties": {"word": {"type": "string", "minLength": 3, "maxLength": 5}},
        "required": ["word"],
    },
    "string_format_date": {
        "type": "object",
        "properties": {"when": {"type": "string", "format": "date"}},
        "required": ["when"],
    },
    "any_of_scalars": {
        "type": "object",
        "properties": {
            "value": {
                "anyOf": [
                    {"type": "integer", "minimum": 0, "maximum": 99},
                    {"type": "string", "maxLength": 5},
                ]
            }
        },
        "required": ["value"],
    },
    "any_of_objects": {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "kind": {"const": "circle"},
                    "r": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["kind", "r"],
                "additionalProperties": False,
            },
            {
                "type": "object",
                "properties": {
                    "kind": {"const": "square"},
                    "side": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["kind", "side"],
                "additionalProperties": False,
            },
        ]
    },
    "defs_ref": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": 0, "maximum": 9},
                    "y": {"type": "integer", "minimum": 0, "maximum": 9},
                },
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
        "type": "object",
        "properties": {"from": {"$ref": "#/$defs/point"}, "to": {"$ref": "#/$defs/point"}},
        "required": ["from", "to"],
    },
    "chained_refs": {
        "$defs": {
            "name": {"type": "string", "maxLength": 8},
            "person": {
                "type": "object",
                "properties": {"name": {"$ref": "#/$defs/name"}, "pet": {"$ref": "#/$defs/pet"}},
                "required": ["name"],
            },
            "pet": {
                "type": "object",
                "properties": {"species": {"enum": ["cat", "dog"]}},
                "required": ["species"],
            },
        },
        "$ref": "#/$defs/person",
    },
    "recursive_tree": {
        "$defs": {
            "node": {
                "type": "object",
                "properties": {
                    "v": {"type": "integer", "minimum": 0, "maximum": 9},
                    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2},
                },
                "required": ["v"],
            }
        },
        "$ref": "#/$defs/node",
    },
    "closed_object_many": {
        "type": "object",
        "properties": {
            "f0": {"type": "integer", "minimum": 0, "maximum": 9},
            "f1": {"type": "integer", "minimum": 0, "maximum": 9},
            "f2": {"type": "integer", "minimum": 0, "maximum": 9},
            "f3": {"type": "integer", "minimum": 0, "maximum": 9},
            "f4": {"type": "integer", "minimum": 0, "maximum": 9},
            "f5": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "required": ["f0", "f3"],
        "additionalProperties": False,
    },
    "string_map": {
        "type": "object",
        "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
        "maxProperties": 3,
    },
    "array_of_objects": {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "pattern": "^[a-z]{2}[0-9]{2}$"},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
                "minItems": 1,
                "maxItems": 2,
            }
        },
        "required": ["items"],
    },
    "tuple_prefix_items": {
        "type": "array",
        "prefixItems": [
            {"type": "string", "maxLength": 4},
            {"type": "integer", "minimum": 0, "maximum": 9},
            {"type": "boolean"},
        ],
        "items": False,
    },
    "matrix": {
        "type": "array",
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 9},
            "minItems": 2,
            "maxItems": 2,
        },
        "minItems": 2,
        "maxItems": 2,
    },
    "top_level_enum": {"enum": ["alpha", "beta", "gamma"]},
    "all_of_single": {
        "allOf": [
            {
                "type": "object",
                "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 3}},
                "required": ["k"],
            }
        ]
    },
    "annotations": {
        "title": "Thing",
        "description": "ignored by the grammar",
        "type": "object",
        "properties": {
            "t": {"type": "string", "description": "a tag", "examples": ["x"], "maxLength": 4}
        },
        "required": ["t"],
        "$comment": "hi",
    },
    "unicode_enum": {
        "type": "object",
        "properties": {"city": {"enum": ["Zürich", "東京", "São Paulo"]}},
        "required": ["city"],
    },
    "min_properties": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": 0, "maximum": 9},
            "b": {"type": "integer", "minimum": 0, "maximum": 9},
        },
        "minProperties": 1,
    },
}
