"""Patterns between JSON Schema and xgrammar: JSON Schema's patterns are ECMA-262 searches,
xgrammar's are full matches (and Python's `re`, which jsonschema uses, reads ECMA's named
groups differently); and strings outside a finite set, written as a pattern xgrammar reads
(for forbidden property names and the complement of a string enum).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from engine.guided.schema_types import UnsupportedSchema

# Regex constructs xgrammar cannot express: lookarounds and backreferences.
_INEXPRESSIBLE_REGEX = re.compile(r"\(\?<?[=!]|\(\?P=|\\[1-9]|\\k<")


def python_regex(pattern: str) -> str:
    """The ECMA-262 pattern in Python's `re` syntax, as far as the two differ harmlessly:
    named groups `(?<name>...)` become `(?P<name>...)`. jsonschema checks and applies patterns
    with `re`, which refuses the ECMA form."""
    return "".join("(?P<" + t[3:] if _named_group(t) else t for t in _regex_tokens(pattern))


def full_match(pattern: str, ptr: str, keyword: str) -> str:
    """A pattern whose full match (xgrammar's reading) is the pattern's search (JSON
    Schema's): each top-level alternative unanchored at an end gets `[\\s\\S]*` there.
    Refuses lookarounds, backreferences, anchors inside groups, and what `re` cannot read."""
    if _INEXPRESSIBLE_REGEX.search(pattern):
        raise UnsupportedSchema(
            ptr,
            keyword,
            f"the pattern {pattern!r} uses a lookaround or backreference, which the grammar "
            "cannot express",
        )
    try:
        re.compile(python_regex(pattern))
    except re.error as exc:
        raise UnsupportedSchema(
            ptr, keyword, f"the pattern {pattern!r} is not a regular expression we read: {exc}"
        ) from None
    alternatives: list[list[str]] = [[]]
    depth = 0
    previous = ""
    for token in _regex_tokens(pattern):
        if token == "|" and depth == 0:
            alternatives.append([])
            previous = token
            continue
        depth += token.startswith("(") - (token == ")")
        if token == "?" and previous == ")":
            token = "{0,1}"  # xgrammar 0.2.9 reads (ab+)? as a?b* (pinned in the tests)
        elif token == "?" and previous == "{0,1}":
            token = ""  # lazy: the same language
        alternatives[-1].append("(?:" if _named_group(token) else token)
        previous = token
    out = []
    for tokens in alternatives:
        start = "" if tokens[:1] == ["^"] else _ANY
        tokens = tokens[1:] if not start else tokens
        end = "" if tokens[-1:] == ["$"] else _ANY
        tokens = tokens[:-1] if not end else tokens
        if "^" in tokens or "$" in tokens:
            raise UnsupportedSchema(
                ptr,
                keyword,
                f"the pattern {pattern!r} has an anchor (^ or $) inside a group or mid-way, "
                "which the grammar cannot express",
            )
        body = "".join(tokens)
        out.append(f"{start}(?:{body}){end}" if body else start + end or "")
    return "|".join(out)


# Any string (JSON Schema patterns apply to the decoded string, newlines included).
_ANY = "[\\s\\S]*"
_NAMED_GROUP = re.compile(r"\(\?<(?![=!])")


def _named_group(token: str) -> bool:
    return token.startswith("(?<") and _NAMED_GROUP.match(token) is not None


def _regex_tokens(pattern: str) -> list[str]:
    """The pattern cut into escapes (`\\x`), character classes (`[...]`, ECMA: the first
    unescaped `]` closes), group openings (`(`, `(?:`, `(?<name>`, ...) and single characters,
    so that `^`, `$`, `|`, `(` and `)` tokens are the regex's own, never literals."""
    tokens: list[str] = []
    i = 0
    while i < len(pattern):
        c = pattern[i]
        j = i + 1
        if c == "\\":
            j = i + 2
        elif c == "[":
            j = i + 2 if pattern.startswith("[^", i) else i + 1
            while j < len(pattern) and pattern[j] != "]":
                j += 2 if pattern[j] == "\\" else 1
            j += 1
        elif c == "(" and pattern.startswith("(?", i):
            named = re.match(r"\(\?(<[A-Za-z_$][\w$]*>|P<\w+>|[:=!]|<[=!])?", pattern[i:])
            j = i + (named.end() if named else 2)
        tokens.append(pattern[i:j])
        i = j
    return tokens


def merge_patterns(x: str | None, y: str, ptr: str) -> str:
    """Both patterns as one, where xgrammar can read it: two none_of sets unite, and a
    none_of set beside another pattern is moot when that pattern matches none of its words."""
    if x is None or x == y:
        return y
    wx, wy = excluded_words(x), excluded_words(y)
    if wx is not None and wy is not None:
        return none_of(wx | wy)
    for words, pattern in ((wx, y), (wy, x)):
        if words is not None and not any(re.fullmatch(python_regex(pattern), w) for w in words):
            return pattern
    raise UnsupportedSchema(ptr, "pattern", f"merging two different patterns ({x!r}, {y!r})")


# pattern -> the finite set of strings it excludes, for every pattern none_of wrote
_EXCLUDED: dict[str, frozenset[str]] = {}
_ANY_CHAR = "[\\s\\S]"
_CLASS_SPECIALS = set("\\]^-[")


def none_of(words: Iterable[str]) -> str:
    """A pattern (full-match, anchored) of every string except these."""
    excluded = frozenset(words)
    trie: dict[str, Any] = {}
    for word in excluded:
        node = trie
        for char in word:
            node = node.setdefault(char, {})
        node[""] = {}  # end of a word
    pattern = f"^{_trie_complement(trie)}$"
    _EXCLUDED[pattern] = excluded
    return pattern


def excluded_words(pattern: Any) -> frozenset[str] | None:
    """The strings a none_of pattern excludes; None for any other pattern."""
    return _EXCLUDED.get(pattern) if isinstance(pattern, str) else None


def _trie_complement(node: dict[str, Any]) -> str:
    """Strings that, read from this trie node, do not end on a word. Optional parts are
    written {0,1}: xgrammar 0.2.9 misreads `(...)?` around a repetition."""
    children = sorted(c for c in node if c)
    if children:
        diverge = "[^" + "".join(_class_char(c) for c in children) + f"]{_ANY_CHAR}*"
    else:
        diverge = f"{_ANY_CHAR}+"
    branches = [diverge] + [re.escape(c) + _trie_complement(node[c]) for c in children]
    body = "(?:" + "|".join(branches) + ")"
    return body if "" in node else body + "{0,1}"


def _class_char(char: str) -> str:
    return "\\" + char if char in _CLASS_SPECIALS else char
