"""grammar.py: constrained decoding on llguidance: a JSON schema (or any JSON object) as the tokens a reply may take.

    constraint = grammar.Constraint(grammar.json_grammar(schema), grammar.tokenizer_for(vocab, model_vocab_size))
    bias = constraint.bias(device)      # [V] float32: 0 where the grammar allows the token, -inf where not
    constraint.consume(token)           # after each token chosen

The bias is added to the logits before sampling, inside the compiled decode step (generate.Sampling.bias), so
constrained and free rows share one batch step and free rows run the step they always ran. The end-of-text tokens
are allowed exactly when the grammar is complete, so a reply that ends by itself always parses.

Why llguidance (MIT): it computes a token mask from a JSON schema or a Lark grammar incrementally, in
microseconds a token, straight from a `tokenizers` tokenizer; xgrammar (Apache-2.0) does the same with a larger
install (its own C++ build and a dependency on transformers' tokenizer classes). Stands on vocab.py and
reasoning.py (a thinking model's grammar starts after its thinking).
"""

from __future__ import annotations

import json

import numpy as np
import torch

from dense_engine.formats.vocab import Vocabulary
from dense_engine.runtime import reasoning
from dense_engine.system.errors import UsageError

# Where JSON allows whitespace, llama.cpp's `space`: none, one space, or one or two line breaks and an indent of at
# most 20. A model writes JSON as it was trained to ({"a": 1}, indented objects), and cannot pad a reply endlessly.
WHITESPACE = r"( |\n{1,2}[ \t]{0,20})?"
JSON_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": WHITESPACE}
# An integer of at most 16 digits (llama.cpp's), a number's whole part the same. llguidance reads a bound as a double,
# which holds 10**16 - 2 exactly (10**16 - 1 would round up to 10**16, 17 digits)
INTEGER_LIMIT = 10**16 - 2
FRACTION = 1e-10  # a number's fraction of at most 10 digits, and no exponent (llguidance: multipleOf, a range)


def llguidance():
    try:
        import llguidance as ll
    except ImportError:
        raise UsageError("constrained decoding needs llguidance (pip install llguidance)") from None
    return ll


def tokenizer_for(vocab: Vocabulary, n_vocab: int):
    """llguidance's view of the checkpoint's tokenizer (built once per vocabulary: about a second), with the
    vocabulary's end-of-text ids as the tokens that end a complete reply; n_vocab: the model's (padded) vocabulary."""
    built = vocab.__dict__.setdefault("llguidance_tokenizers", {})  # (kept with the vocabulary it was made from)
    if n_vocab not in built:
        stops = sorted(vocab.stop_ids) or None
        built[n_vocab] = llguidance().LLTokenizer(vocab.tokenizer.to_str(), n_vocab=n_vocab, eos_token=stops)
    return built[n_vocab]


SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> a whole schema
SCHEMA_VALUES = ("const", "enum", "default", "examples", "required")  # values, not schemas
PARTS = ("allOf", "if", "then", "else", "not", "dependentSchemas")  # pieces of their parent's object, never whole
COMBINED = (*PARTS, "anyOf", "oneOf", "unevaluatedProperties")  # an object whose properties these add to or judge


def closed_objects(schema, whole: bool = True):
    """The schema with additionalProperties false on every whole object schema that names properties and does not
    say (llama.cpp's rule, and OpenAI's strict mode: else a small model invents properties until its tokens run out).
    Not closed: an object whose properties other subschemas add to or judge (allOf, anyOf, oneOf, if/then/else, not,
    dependentSchemas, unevaluatedProperties), nor those subschemas themselves, each a piece of its parent's object;
    anyOf and oneOf alternatives are whole when their parent names no properties."""
    if isinstance(schema, list):
        return [closed_objects(s, whole) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_objects(s) for name, s in value.items()}
        elif key in SCHEMA_VALUES:
            out[key] = value
        elif key == "dependentSchemas" and isinstance(value, dict):
            out[key] = {name: closed_objects(s, whole=False) for name, s in value.items()}
        elif key in PARTS or key in ("anyOf", "oneOf"):
            out[key] = closed_objects(value, whole=key not in PARTS and "properties" not in schema)
        else:
            out[key] = closed_objects(value)
    if whole and "properties" in out and "additionalProperties" not in out and not any(k in out for k in COMBINED):
        out["additionalProperties"] = False
    return out


def bounded_numbers(schema):
    """The schema with each integer and number bounded where it says nothing of its own: at most 16 digits (its
    minimum and maximum), a number's fraction at most 10 digits (its multipleOf). Unbounded, a small model writes
    digits until max_tokens cuts the reply (population: 1112200000000000000000...)."""
    if isinstance(schema, list):
        return [bounded_numbers(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: value if key in SCHEMA_VALUES else
           {name: bounded_numbers(s) for name, s in value.items()} if key in SCHEMA_MAPS and isinstance(value, dict)
           else bounded_numbers(value) for key, value in schema.items()}
    kinds = out.get("type") if isinstance(out.get("type"), list) else [out.get("type")]
    number, integer = "number" in kinds, "integer" in kinds
    if number or integer:
        limit = INTEGER_LIMIT if integer and not number else float(INTEGER_LIMIT)
        low = [v for v in (out.get("minimum"), out.get("exclusiveMinimum")) if isinstance(v, (int, float))]
        high = [v for v in (out.get("maximum"), out.get("exclusiveMaximum")) if isinstance(v, (int, float))]
        if not low and all(v >= -limit for v in high):
            out["minimum"] = -limit
        if not high and all(v <= limit for v in low):
            out["maximum"] = limit
    if number and "multipleOf" not in out:
        out["multipleOf"] = FRACTION
    return out


def held(schema: dict) -> dict:
    """The schema a grammar holds a reply to: objects closed (closed_objects), numbers bounded (bounded_numbers)."""
    return bounded_numbers(closed_objects(schema))


def json_grammar(schema: dict | None = None) -> str:
    """The grammar of a JSON value that validates against `schema` (None: any JSON object; as `held` says), written
    with JSON_OPTIONS' whitespace; ValueError if the schema is not one llguidance can compile (a keyword it does not
    hold: llguidance names it)."""
    ll = llguidance()
    schema = {"type": "object"} if schema is None else schema
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object")  # noqa: TRY004 (the ValueError the docstring says)
    grammar = ll.LLMatcher.grammar_from_json_schema(json.dumps(held(schema)), overrides=JSON_OPTIONS)
    error = ll.LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(error.splitlines()[0])
    return grammar


def checked(grammar: str) -> str:
    """grammar, or ValueError with the first line of llguidance's complaint."""
    error = llguidance().LLMatcher.validate_grammar(grammar)
    if error and not error.startswith("WARNING"):
        raise ValueError(" ".join(error.split("\n")[:1]).strip())
    return grammar


def regex_grammar(pattern: str) -> str:
    """Text matching a regular expression (Rust's regex syntax, as vLLM's guided_regex)."""
    return checked(llguidance().LLMatcher.grammar_from_regex(pattern))


def choice_grammar(choices: list[str]) -> str:
    """Exactly one of the strings."""
    return checked(llguidance().LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices)))


def lark_grammar(text: str) -> str:
    """A context-free grammar in Lark's syntax (vLLM's guided_grammar) or in llama.cpp's GBNF (llama-server's
    `grammar`): llguidance tells them apart and converts GBNF."""
    from llguidance.gbnf_to_lark import any_to_lark

    try:
        lark = any_to_lark(text)
    except Exception as e:  # noqa: BLE001 (the converter's own errors: GbnfToLarkError, and what its parser raises)
        raise ValueError(" ".join(str(e).split())) from None
    return checked(llguidance().LLMatcher.grammar_from_lark(lark))


class Constraint:
    """One reply's grammar state: which tokens may come next, updated as tokens are chosen."""

    def __init__(self, grammar: str, tokenizer, n_vocab: int) -> None:
        ll = llguidance()
        self.matcher = ll.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(self.matcher.get_error().splitlines()[0])
        self.n_vocab = n_vocab

    def bias(self, device) -> torch.Tensor:
        """[V] float32: 0 for the tokens the grammar allows next, -inf for the others."""
        words = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(words, bitorder="little")[: self.n_vocab].astype(bool)
        bias = np.where(allowed, np.float32(0), np.float32(-np.inf))
        if not allowed.any():  # (an error state: let the end-of-text tokens through rather than nothing)
            bias[:] = 0
        return torch.from_numpy(bias).to(device)

    def consume(self, token: int) -> None:
        self.matcher.consume_token(int(token))

    @property
    def done(self) -> bool:
        """The grammar takes no more tokens (complete, or in an error state)."""
        return self.matcher.is_stopped() or self.matcher.is_error()


class Lazy(Constraint):
    """A grammar that starts after a trigger (llama.cpp's lazy grammars): the reply is free until its text holds
    `trigger` (a tool call's opener, a thinking model's </think>); then the text after it goes into the grammar,
    which holds every later token. opens: a token the reply may start with instead (a thinking model's <think>):
    then the grammar holds from the first token unless that token opens a thinking, and waits for the trigger if
    it does."""

    def __init__(self, grammar: str, tokenizer, n_vocab: int, trigger: str, opens: int | None = None) -> None:
        super().__init__(grammar, tokenizer, n_vocab)
        self.tokenizer, self.trigger, self.opens = tokenizer, trigger, opens
        self.waiting, self.ids = opens is None, []

    def bias(self, device) -> torch.Tensor:
        if self.waiting:
            return torch.zeros(self.n_vocab, device=device)
        bias = super().bias(device)
        if self.opens is not None and not self.ids:
            bias[self.opens] = 0
        return bias

    def consume(self, token: int) -> None:
        first = not self.ids
        self.ids.append(int(token))
        if not self.waiting:
            if first and token == self.opens:
                self.waiting = True
                return
            return super().consume(token)
        text = self.tokenizer.decode_str(self.ids[-64:])  # (the trigger is a few tokens, just written)
        at = text.find(self.trigger)
        if at >= 0:
            self.waiting = False
            rest = text[at + len(self.trigger):]
            rest = rest.lstrip() if self.trigger in reasoning.CLOSES else rest  # (an answer's blank lines: not its own)
            if rest:
                self.matcher.consume_tokens(self.tokenizer.tokenize_str(rest))

    @property
    def done(self) -> bool:
        return not self.waiting and super().done
