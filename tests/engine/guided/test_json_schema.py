"""engine/guided/schema.py: every rewrite proved against the jsonschema validator on xgrammar's
own matcher (strings the grammar must accept are valid, violations are rejected), the holes
in xgrammar 0.2.9 that make each rewrite necessary, refusals by pointer, end checks, and
outputs of the demo model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import xgrammar as xgr

from engine import LLM, SamplingParams
from engine.errors import GuidedSpecError
from engine.guided import check_schema, schema_end_checks
from engine.guided.schema import normalize_schema, python_regex
from engine.request import GuidedSpec

FORMATS = jsonschema.FormatChecker()
_COMPILER = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False)


def accepts(schema: dict[str, Any], text: str, strict: bool = False) -> bool:
    """Does xgrammar's grammar for the schema (compact JSON) accept exactly this text?"""
    compiled = _COMPILER.compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":"), strict_mode=strict
    )
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(text) and matcher.is_terminated()


def valid(schema: dict[str, Any], text: str) -> bool:
    return jsonschema.validators.validator_for(schema)(schema, format_checker=FORMATS).is_valid(
        json.loads(text)
    )


CLOSED_A = {
    "type": "object",
    "properties": {"a": {"type": "integer"}},
    "additionalProperties": False,
}
NODE = {
    "type": "object",
    "properties": {
        "v": {"type": "integer", "minimum": 0, "maximum": 9},
        "kids": {"type": "array", "items": {"$ref": "#/definitions/node"}, "maxItems": 2},
    },
    "required": ["v"],
    "additionalProperties": False,
}
# name: (schema, documents the grammar must accept, violations it must reject). A violation
# marked "hole" is one raw xgrammar 0.2.9 accepts: the reason for the rewrite.
CASES: dict[str, tuple[dict[str, Any], list[str], list[str]]] = {
    "allOf_closed_object": (
        {"allOf": [CLOSED_A, {"properties": {"b": {"type": "string"}}, "required": ["a"]}]},
        ['{"a":1}'],
        ['{"a":1,"b":"x"}', "{}", '{"a":"x"}'],
    ),
    "allOf_open_parts": (
        {
            "allOf": [
                {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"properties": {"b": {"type": "string"}}, "required": ["b"]},
            ]
        },
        ['{"a":1,"b":"x"}'],
        ['{"a":1}', '{"b":"x"}', '{"a":1,"b":2}'],
    ),
    "ref_with_siblings": (
        {"definitions": {"o": CLOSED_A}, "$ref": "#/definitions/o", "required": ["a"]},
        ['{"a":1}'],
        ["{}", '{"a":1,"b":2}'],
    ),
    "ref_closed_through_allOf_property": (
        {
            "$defs": {"base": CLOSED_A},
            "type": "object",
            "properties": {"x": {"allOf": [{"$ref": "#/$defs/base"}, {"required": ["a"]}]}},
            "required": ["x"],
        },
        ['{"x":{"a":3}}'],
        ['{"x":{"a":3,"z":1}}', '{"x":{}}'],
    ),
    "ref_pointer_and_escapes": (
        {
            "$defs": {"a/b": {"type": "integer"}, "c d": {"type": "string", "maxLength": 2}},
            "type": "object",
            "properties": {
                "p": {"$ref": "#/$defs/a~1b"},
                "q": {"$ref": "#/$defs/c%20d"},
                "r": {"$ref": "#/properties/p"},
            },
            "required": ["p", "q", "r"],
            "additionalProperties": False,
        },
        ['{"p":1,"q":"ab","r":2}'],
        ['{"p":"x","q":"ab","r":2}', '{"p":1,"q":"abc","r":2}', '{"p":1,"q":"a","r":"x"}'],
    ),
    "recursive_definitions": (
        {"definitions": {"node": NODE}, "$ref": "#/definitions/node"},
        ['{"v":1}', '{"v":1,"kids":[{"v":2,"kids":[{"v":3}]}]}'],
        ['{"v":1,"kids":[{"v":10}]}', '{"v":1,"kids":[{"w":1}]}'],
    ),
    "recursive_root": (
        {"type": "object", "properties": {"c": {"$ref": "#"}}, "additionalProperties": False},
        ['{"c":{"c":{}}}'],
        ['{"c":{"d":1}}'],
    ),
    "oneOf_types": (
        {"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 3}]},
        ["1", '"abc"'],
        ["null", '"abcd"'],
    ),
    "oneOf_discriminator": (
        {
            "oneOf": [
                {
                    "type": "object",
                    "properties": {"kind": {"const": "a"}, "x": {"type": "integer"}},
                    "required": ["kind", "x"],
                    "additionalProperties": False,
                },
                {
                    "type": "object",
                    "properties": {"kind": {"const": "b"}, "y": {"type": "boolean"}},
                    "required": ["kind", "y"],
                    "additionalProperties": False,
                },
            ]
        },
        ['{"kind":"a","x":1}', '{"kind":"b","y":true}'],
        ['{"kind":"a","y":true}', '{"kind":"c","x":1}'],
    ),
    "anyOf_with_siblings": (
        {"type": "string", "anyOf": [{"maxLength": 2}, {"minLength": 5}]},
        ['"ab"', '"abcde"'],
        ['"abc"', "1"],  # hole: xgrammar ignores the anyOf's siblings
    ),
    "enum_and_const_with_siblings": (
        {
            "type": "object",
            "properties": {
                "e": {"type": "integer", "enum": [1, "a", 2.5, {"k": [1]}, 3]},
                "c": {"type": "string", "const": "v"},
                "o": {"enum": [{"k": [1, None]}, [True, "x"]]},
            },
            "required": ["e", "c", "o"],
            "additionalProperties": False,
        },
        ['{"e":1,"c":"v","o":{"k":[1,null]}}', '{"e":3,"c":"v","o":[true,"x"]}'],
        ['{"e":"a","c":"v","o":[true,"x"]}', '{"e":1,"c":"v","o":[true]}'],
    ),
    "required_missing_from_properties": (
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["z"]},
        ['{"z":1}', '{"a":1,"z":[]}'],
        ["{}", '{"a":1}'],
    ),
    "typed_keywords_without_type": (
        {
            "type": "object",
            "properties": {"s": {"minLength": 3}, "n": {"minimum": 3}},
            "required": ["s", "n"],
        },
        ['{"s":"abc","n":5}', '{"s":1,"n":"x"}'],
        ['{"s":"a","n":5}', '{"s":"abc","n":1}'],  # hole: ignored without a type
    ),
    "boolean_subschemas": (
        {
            "type": "object",
            "properties": {"any": True, "never": False, "list": {"type": "array", "items": False}},
            "required": ["any", "list"],
            "additionalProperties": False,
        },
        ['{"any":{"x":[1]},"list":[]}'],
        ['{"any":1,"list":[],"never":1}', '{"any":1,"list":[1]}'],
    ),
    "draft4_forms": (
        {
            "$schema": "http://json-schema.org/draft-04/schema#",
            "type": "object",
            "properties": {
                "t": {"type": "array", "items": [{"type": "integer"}], "additionalItems": False},
                "x": {"type": "number", "minimum": 0, "exclusiveMinimum": True},
            },
            "required": ["t", "x"],
        },
        ['{"t":[1],"x":0.5}'],
        ['{"t":[1,2],"x":1}', '{"t":[1],"x":0}'],
    ),
    "formats": (
        {
            "type": "object",
            "properties": {
                f: {"type": "string", "format": f}
                for f in ("date-time", "date", "time", "uuid", "email", "uri", "ipv4", "ipv6")
            },
            "required": ["date", "uuid", "ipv4"],
        },
        ['{"date":"2024-01-02","uuid":"123e4567-e89b-12d3-a456-426614174000","ipv4":"1.2.3.4"}'],
        ['{"date":"yesterday","uuid":"123e4567-e89b-12d3-a456-426614174000","ipv4":"1.2.3.4"}'],
    ),
    "uniqueItems_end_checked": (
        {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3},
        ["[1,2]"],
        ["[1,2,3,4]"],  # duplicates are the end check's
    ),
    "not_enum_of_strings": (
        {"type": "string", "not": {"enum": ["a", "ab", "a.b"]}},
        ['"b"', '"abc"', '""', '"aab"', '"a.c"'],
        ['"a"', '"ab"', '"a.b"'],
    ),
    "not_type_and_bounds": (
        {"not": {"type": "string", "maxLength": 2}},
        ["1", "null", "{}", '"abc"'],
        ['"ab"', '""'],
    ),
    "not_required": (
        {"type": "object", "not": {"required": ["a", "b"]}},
        ["{}", '{"a":1}', '{"b":1,"c":2}'],
        ['{"a":1,"b":2}'],
    ),
    "if_then_else_discriminator": (
        {
            "type": "object",
            "properties": {"version": {"type": "string"}},
            "if": {"properties": {"version": {"const": "v1"}}},
            "then": {"properties": {"deps": {"type": "integer"}}},
            "else": {"properties": {"deps": {"type": "string"}}, "required": ["deps"]},
        },
        ['{"version":"v1","deps":1}', '{"version":"v1"}', '{"version":"v2","deps":"x"}'],
        ['{"version":"v1","deps":"x"}', '{"version":"v2","deps":1}', '{"version":"v2"}'],
    ),
    "if_required_then": (
        {
            "type": "object",
            "if": {"properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"]},
            "then": {"required": ["x"]},
        },
        ['{"kind":"a","x":1}', '{"kind":"c"}', "{}", '{"x":1}'],
        ['{"kind":"a"}', '{"kind":"b","y":1}'],
    ),
    "if_else_only": (
        {"type": "integer", "if": {"minimum": 10}, "else": {"maximum": 3}},
        ["12", "10", "2"],
        ["5", "9"],
    ),
    "dependencies": (
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "dependencies": {"a": ["b"], "c": {"properties": {"b": {"const": 1}}}},
        },
        ['{"a":1,"b":2}', '{"b":2}', "{}", '{"b":1,"c":0}', '{"c":0}'],
        ['{"a":1}', '{"c":0,"b":2}'],
    ),
    "dependent_required_and_schemas": (
        {
            "type": "object",
            "dependentRequired": {"a": ["b"]},
            "dependentSchemas": {"b": {"properties": {"a": {"type": "string"}}}},
        },
        ['{"b":1,"a":"x"}', '{"b":1}', "{}"],  # xgrammar keeps the declared order
        ['{"a":"x"}', '{"a":1,"b":1}'],
    ),
    "false_property_of_an_open_object": (
        {"type": "object", "properties": {"a": {"type": "integer"}, "x": False}},
        ['{"a":1}', '{"y":1}', '{"xy":2}', '{"a":1,"b":"x"}'],
        ['{"x":1}', '{"a":"s"}', '{"a":1,"x":1}'],
    ),
    "property_names_not_enum": (
        {
            "type": "object",
            "properties": {"$schema": {"type": "string"}},
            "propertyNames": {"not": {"enum": ["concurrent", "ignore"]}},
            "additionalProperties": {"type": "integer"},
        },
        ['{"$schema":"x","lint":1}', '{"ignores":1}', "{}"],
        ['{"ignore":1}', '{"$schema":1}', '{"lint":"x"}', '{"concurrent":1}'],
    ),
    "property_names_enum_beside_properties": (
        {
            "type": "object",
            "properties": {"a": {"type": "integer"}},
            "propertyNames": {"enum": ["a", "b"]},
        },
        ['{"a":1,"b":"s"}', '{"b":[]}'],
        ['{"a":"s"}', '{"c":1}'],  # hole: {"a":"s"} as an additional key named a
    ),
    "optional_group_with_repetition": (
        {"type": "string", "pattern": "^id(-[0-9]+)?$"},
        ['"id"', '"id-25"'],
        ['"id1"', '"id-"'],  # hole: xgrammar reads (-[0-9]+)? as -?[0-9]*
    ),
    "prefix_items_booleans": (
        {
            "$schema": "http://json-schema.org/draft-07/schema#",
            "type": "array",
            "items": [{"type": "integer"}, True, False],
            "minItems": 1,
        },
        ["[1]", '[1,"x"]', "[1,{}]"],
        ["[1,2,3]", '["x"]', "[]"],
    ),
    "min_items_without_items": (  # strict mode: no items is items false, [] only
        {"type": "array", "minItems": 1, "maxItems": 2},
        ["[1]", '["x",2]'],
        ["[]", "[1,2,3]"],
    ),
    "integer_bounds_rounded": (
        {"type": "integer", "minimum": 0.5, "maximum": 3.5},
        ["1", "3"],
        ["0", "4"],
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_normalized_schemas_are_enforced(name: str) -> None:
    schema, good, bad = CASES[name]
    normalized = normalize_schema(schema).schema
    for text in good:
        assert valid(schema, text), text
        assert accepts(normalized, text), text
        assert accepts(normalized, text, strict=True) or "{" in text, text
    for text in bad:
        assert not valid(schema, text), text
        assert not accepts(normalized, text), text


@pytest.mark.parametrize(
    ("schema", "violation"),
    [
        (CASES["allOf_closed_object"][0], '{"a":1,"b":"x"}'),
        (CASES["ref_with_siblings"][0], "{}"),
        (CASES["anyOf_with_siblings"][0], "1"),
        (CASES["enum_and_const_with_siblings"][0], '{"e":"a","c":"v","o":[true,"x"]}'),
        ({"type": "object", "required": ["z"]}, "{}"),
        (CASES["typed_keywords_without_type"][0], '{"s":"a","n":5}'),
        ({"type": "array", "contains": {"type": "integer"}}, '["a"]'),
        ({"type": "object", "properties": {"a": {}}, "unevaluatedProperties": False}, '{"b":1}'),
        ({"type": "number", "multipleOf": 0.5}, "0.3"),
        ({"type": "string", "pattern": "^(?!foo)[a-z]+$"}, '"foo"'),
        ({"type": "string", "pattern": "^id(-[0-9]+)?$"}, '"id1"'),
        ({"type": "string", "pattern": "^a[a-z]*$", "maxLength": 3}, '"abcd"'),
        ({"type": "string", "format": "date", "pattern": "^2"}, '"1999-01-01"'),
        (CASES["property_names_enum_beside_properties"][0], '{"a":"s"}'),
        ({"type": "string", "not": {"const": "a"}}, '"a"'),
        ({"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}}, '{"a":1}'),
    ],
)
def test_the_holes_in_xgrammar_that_normalizing_closes(
    schema: dict[str, Any], violation: str
) -> None:
    """Raw xgrammar accepts each violation; when one starts failing, a rewrite may be moot."""
    assert accepts(schema, violation) and not valid(schema, violation)


@pytest.mark.parametrize(
    ("schema", "checks"),
    [
        ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, (("", "oneOf"),)),
        (CASES["oneOf_types"][0], ()),
        (CASES["oneOf_discriminator"][0], ()),
        (
            {"oneOf": [{"required": ["a"]}, {"required": ["b"]}], "type": "object"},
            (("", "oneOf"),),
        ),
        (
            {
                "oneOf": [
                    {
                        "type": "object",
                        "properties": {"a": {}},
                        "required": ["a"],
                        "additionalProperties": False,
                    },
                    {
                        "type": "object",
                        "properties": {"b": {}},
                        "required": ["b"],
                        "additionalProperties": False,
                    },
                ]
            },
            (),
        ),
        (
            {"type": "object", "properties": {"tags": CASES["uniqueItems_end_checked"][0]}},
            (("/properties/tags", "uniqueItems"),),
        ),
        (CASES["allOf_closed_object"][0], ()),
        ({"type": "string", "pattern": "^a", "maxLength": 3}, (("", "maxLength"),)),
        ({"type": "string", "format": "date", "pattern": "^2"}, (("", "format"),)),
        (
            {"type": "object", "properties": {"a": {}}, "propertyNames": {"pattern": "^[a-z]+$"}},
            (("", "propertyNames"),),
        ),
        (CASES["property_names_not_enum"][0], ()),
    ],
)
def test_end_checks_name_what_decoding_does_not_enforce(
    schema: dict[str, Any], checks: tuple[tuple[str, str], ...]
) -> None:
    assert normalize_schema(schema).end_checks == checks
    assert schema_end_checks(schema) == checks


def test_oneOf_left_overlapping_is_anyOf_plus_the_end_check() -> None:
    schema = {"oneOf": [{"type": "integer"}, {"type": "number"}]}
    normalized = normalize_schema(schema).schema
    assert accepts(normalized, "1") and not valid(schema, "1")  # the end check's to catch
    assert accepts(normalized, "1.5") and not accepts(normalized, '"x"')


LOOKAHEAD = "^(?!x-)[a-z]+$"
# (schema, the words the refusal must hold: the pointer, keyword and pattern)
REFUSED = [
    (
        {"properties": {"x": {"$ref": "https://example.com/s.json"}}},
        "at /properties/x/$ref: external reference 'https://example.com/s.json'",
    ),
    ({"patternProperties": {LOOKAHEAD: {}}}, f"at /patternProperties: the pattern '{LOOKAHEAD}'"),
    (
        {"propertyNames": {"pattern": LOOKAHEAD}},
        f"at /propertyNames/pattern: the pattern '{LOOKAHEAD}'",
    ),
    ({"items": {"pattern": "(a)\\1"}}, "at /items/pattern: the pattern '(a)\\\\1'"),
    ({"pattern": "(?<=a)b"}, "lookaround or backreference"),
    ({"pattern": "(?P<n>a)(?P=n)"}, "at /pattern"),
    (
        {"properties": {"re": {"type": "string", "pattern": "^(a(?1)?b)$"}}},
        "at /properties/re/pattern: '^(a(?1)?b)$' is not a 'regex'",
    ),
    ({"patternProperties": {"(^a|b)": {}}}, "at /patternProperties: the pattern '(^a|b)' has an"),
    ({"properties": {"a": {"not": {"type": "integer"}}}}, "at /properties/a/not/type: the"),
    ({"not": {"type": "string", "pattern": "^a"}}, "at /not/pattern: the complement of"),
    ({"not": {"enum": ["a", 1]}}, "the complement of an enum of numbers"),
    (
        {"$defs": {"d": {"if": {"format": "date"}, "then": {}}}, "$ref": "#/$defs/d"},
        "at /$defs/d/if/format: the complement of 'format'",
    ),
    (
        {"type": "object", "dependencies": {k: [k + "x"] for k in "abcdefg"}},
        "more than 64 merged branches",
    ),
    (
        {"type": "object", "patternProperties": {"^x": {}}, "properties": {"a": False}},
        "at /properties/a: a false property beside patternProperties",
    ),
    ({"type": "array", "contains": {"type": "integer"}}, "at /contains"),
    ({"type": "number", "multipleOf": 0.5}, "at /multipleOf"),
    ({"$ref": "#/$defs/missing"}, "at /$ref: cannot resolve"),
    ({"allOf": [{"type": "string"}, {"type": "integer"}]}, "accepts no value"),
]


@pytest.mark.parametrize(("schema", "words"), REFUSED, ids=[w for _, w in REFUSED])
def test_refusals_name_the_pointer_and_keyword(schema: dict[str, Any], words: str) -> None:
    with pytest.raises(GuidedSpecError) as refused:
        check_schema(schema, max_depth=32)
    assert words in str(refused.value)


# -- the demo model ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(demo_model_dir: Path) -> LLM:
    return LLM(
        str(demo_model_dir),
        kv_cache_memory=64 << 20,
        max_model_len=512,
        num_threads=1,
        dtype="float32",
    )


def test_demo_outputs_follow_the_normalized_schemas(llm: LLM) -> None:
    names = [n for n in CASES if n not in ("formats",)]  # unbounded strings: run to max_tokens
    prompts, params = [], []
    for i, name in enumerate(names):
        spec = GuidedSpec(json_schema=CASES[name][0])
        for seed in (i, i + 100):
            prompts.append("JSON:")
            params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=64, guided=spec))
    outputs = llm.generate(prompts, params)
    finished = 0
    for k, output in enumerate(outputs):
        schema = CASES[names[k // 2]][0]
        completion = output.outputs[0]
        assert completion.finish_reason in ("stop", "length"), (names[k // 2], output.error)
        if completion.finish_reason == "stop":
            finished += 1
            document = json.loads(completion.text)
            if not schema_end_checks(schema):  # else only the end check may decide
                jsonschema.validators.validator_for(schema)(schema).validate(document)
    assert finished >= len(outputs) // 6  # random weights: numbers and open objects run on


# -- patterns: JSON Schema searches, xgrammar matches the whole string ---------------------------

# pattern: strings on which xgrammar's grammar (after normalizing) and the jsonschema validator
# must agree, matches and non-matches alike.
PATTERNS: dict[str, list[str]] = {
    "^https?://": ["http://", "https://x.org", "ftp://x", "xhttp://", ""],
    "https?://": ["http://", "see http://x", "http:/", "ftp://x"],
    "a$": ["a", "ba", "ab", ""],
    "^a$": ["a", "aa", "ba", ""],
    "a": ["a", "bab", "b", ""],
    "a|^b$": ["a", "xax", "b", "xb", "bx", ""],
    "^a|b$": ["ab", "xb", "ax", "xa", "bx"],
    "(?:^a|^b)": ["a", "b", "x"],  # refused below: anchors inside a group
    "\\^a\\$": ["^a$", "x^a$y", "a", "^a"],
    "[$^]": ["^", "$", "x$x", "a"],
    "[^a]": ["a", "aa", "ab", ""],
    "^(?<major>0|[1-9]\\d*)\\.(?<minor>\\d+)$": ["1.2", "01.2", "1.2.3", "10.0"],
    "^[a-z]+(?:-[a-z]+)*$": ["ab-cd", "ab-", "-ab", "ab"],
    "(a|b)c": ["ac", "xbcx", "c", "ab"],
    "": ["", "x"],
    "^$": ["", "x"],
}
ANCHORS_IN_GROUPS = {"(?:^a|^b)"}


@pytest.mark.parametrize("pattern", PATTERNS)
def test_patterns_are_searches_as_in_json_schema(pattern: str) -> None:
    schema = {"type": "string", "pattern": pattern}
    if pattern in ANCHORS_IN_GROUPS:
        with pytest.raises(GuidedSpecError, match="at /pattern: the pattern .* anchor"):
            check_schema(schema, max_depth=32)
        return
    normalized = check_schema(schema, max_depth=32).schema
    python = {"type": "string", "pattern": python_regex(pattern)}  # jsonschema reads `re`
    for text in map(json.dumps, PATTERNS[pattern]):
        assert accepts(normalized, text) == valid(python, text), (pattern, text)


def test_raw_xgrammar_matches_patterns_in_full() -> None:
    """The hole: raw xgrammar reads `^https?://` as the whole string."""
    schema = {"type": "string", "pattern": "^https?://"}
    assert not accepts(schema, '"https://x.org"') and valid(schema, '"https://x.org"')


def test_pattern_properties_and_property_names_are_searches() -> None:
    schema = {
        "type": "object",
        "patternProperties": {"^x-": {"type": "integer"}},
        "propertyNames": {"pattern": "^[a-z]"},
        "additionalProperties": False,
    }
    normalized = normalize_schema(schema).schema
    for text in ['{"x-a":1}', '{"x-":1}', '{"y-a":1}', '{"x-a":"s"}', "{}"]:
        assert accepts(normalized, text) == valid(schema, text), text


def test_ecma_named_groups_pass_the_schema_check() -> None:
    schema = {"type": "string", "pattern": "^(?<year>\\d{4})-(?<month>\\d{2})$"}
    normalized = check_schema(schema, max_depth=32).schema
    assert accepts(normalized, '"2024-01"') and not accepts(normalized, '"2024-1"')
    assert "?<" not in normalized["pattern"]
