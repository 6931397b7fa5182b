"""Grammar drafting: the tokens a tool call's grammar forces, drafted with no model at all.

:class:`ToolCallGrammar` builds llguidance grammars of valid calls from the request's tools,
``tool_choice`` and ``response_format``. :class:`GrammarDrafter` follows the committed tokens, starts a
matcher where they open a call (``<tool_call>``, a ```` ```json ```` fence, a bare JSON answer, or the
answer's start when structure is demanded), drafts the forced tokens and tells other drafters how much of
their proposal the grammar allows. The target still decides every token: when it leaves the grammar the
matcher is dropped until the next opening.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from agentspec.drafters.base import DraftContext, common_prefix, register_drafter
from agentspec.drafters.json_grammar import LarkJson, call_rule, grammar_text, lit, schema_rule
from agentspec.toolcalls import normalise_tools
from agentspec.types import DraftProposal

_OPEN_TAG, _CLOSE_TAG, _FENCE = "<tool_call>", "</tool_call>", "```"

_LL_LOCK = threading.Lock()
_LL_TOKENIZERS: dict[int, tuple[Any, Any]] = {}  # id(hf tokenizer) -> (tokenizer, llguidance tokenizer)


def ll_tokenizer(tokenizer: Any) -> Any:
    """llguidance's view of a Hugging Face tokenizer (built once per tokenizer: about 2 s for 150k tokens)."""
    import llguidance.hf

    with _LL_LOCK:
        hit = _LL_TOKENIZERS.get(id(tokenizer))
        if hit is None or hit[0] is not tokenizer:
            try:
                ll = llguidance.hf.from_tokenizer(tokenizer)
            except ValueError:  # a tokenizer.json llguidance cannot read (e.g. a Fuse decoder): go by ids
                ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokensByText(tokenizer)))
            hit = (tokenizer, ll)
            if len(_LL_TOKENIZERS) >= 8:
                _LL_TOKENIZERS.pop(next(iter(_LL_TOKENIZERS)))
            _LL_TOKENIZERS[id(tokenizer)] = hit
        return hit[1]


log = logging.getLogger(__name__)


def warm_grammar_tokenizer(tokenizer: Any) -> threading.Thread:
    """Start building :func:`ll_tokenizer` on a daemon thread, ahead of the first request that needs it (it
    takes seconds for a 150k vocabulary); a warning if it cannot be built. Returns the started thread."""
    def build() -> None:
        try:
            ll_tokenizer(tokenizer)
        except Exception as e:  # a tokenizer the grammar engine cannot read: constrained requests will say so
            log.warning("could not build the grammar engine's tokenizer: %s", e)

    thread = threading.Thread(target=build, name="agentspec-grammar", daemon=True)
    thread.start()
    return thread


class _TokensByText:
    """A tokenizer described to llguidance by each token's decoded text (for non-byte-level vocabularies)."""

    def __init__(self, tokenizer: Any) -> None:
        special = set(tokenizer.all_special_ids)
        self.eos_token_id, self.bos_token_id = tokenizer.eos_token_id, tokenizer.bos_token_id
        self.special_token_ids = sorted(special)
        self.tokens = [(tokenizer.convert_ids_to_tokens(i) if i in special else tokenizer.decode([i])).encode()
                       for i in range(len(tokenizer))]
        self._tokenizer = tokenizer

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer(text, add_special_tokens=False)["input_ids"]


def _special_or_literal(tokenizer: Any, text: str) -> str:
    """``<[id]>`` when ``text`` is one added (special) token of the tokenizer, else a string literal."""
    ids = tokenizer.convert_tokens_to_ids([text]) if hasattr(tokenizer, "convert_tokens_to_ids") else [None]
    unk = getattr(tokenizer, "unk_token_id", None)
    if ids and isinstance(ids[0], int) and ids[0] != unk and ids[0] >= 0:
        return f"<[{ids[0]}]>"
    return lit(text)


@dataclass(frozen=True)
class _Opening:
    """Committed text that opens a structured span, and the grammar (start rule body) that follows it."""

    suffix: str
    body: str


class ToolCallGrammar:
    """Compiled grammars of one request's structured output, keyed by how the span was opened."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None,
                 tool_choice: str | dict[str, Any] | None = None,
                 response_format: dict[str, Any] | None = None) -> None:
        import llguidance

        self._ll = ll_tokenizer(tokenizer)
        self._llguidance = llguidance
        tools = normalise_tools(tools) or []
        if tool_choice == "none":
            tools = []
        elif isinstance(tool_choice, dict):
            wanted = (tool_choice.get("function") or {}).get("name")
            tools = [t for t in tools if (t.get("function") or {}).get("name") == wanted]
        tools = [t["function"] for t in tools if (t.get("function") or {}).get("name")]
        # both layouts targets use: compact (Qwen's tojson) and two-space indents (json.dumps(indent=2))
        self._layouts = (LarkJson(None, "c"), LarkJson(2, "p"))
        self.openings: list[_Opening] = []
        self.at_start: str | None = None  # grammar engaged before the answer's first token
        self.bare: str | None = None  # grammar engaged when the answer's first token starts a JSON value
        self.calls: str | None = None  # one or more tagged calls: what tool_choice "required" enforces
        self.one_call: str | None = None  # one tagged call: a named tool, or parallel_tool_calls=False
        self.value: str | None = None  # the JSON answer response_format enforces
        if tools:
            one = " | ".join(call_rule(g, t["name"], t.get("parameters"), 0) for g in self._layouts for t in tools)
            lists = []
            for g in self._layouts:
                item = " | ".join(call_rule(g, t["name"], t.get("parameters"), 1) for t in tools)
                open_, sep, close = lit("[" + g.newline(1)), lit(g.sep(0)), lit(g.newline(0) + "]")
                lists.append(f"{open_} ({item}) ({sep} ({item}))* {close}")
            many = " | ".join([one, *lists])
            close_tag = _special_or_literal(tokenizer, _CLOSE_TAG)
            in_tag = f'({one}) "\\n" {close_tag}'
            in_fence = f'({many}) "\\n{_FENCE}"'
            self.openings = [_Opening(_OPEN_TAG, f'"\\n" {in_tag}'), _Opening(_OPEN_TAG + "\n", in_tag),
                             _Opening(_FENCE + "json", f'"\\n" {in_fence}'), _Opening(_FENCE + "json\n", in_fence)]
            self.bare = many
            tagged = f'{_special_or_literal(tokenizer, _OPEN_TAG)} "\\n" {in_tag}'
            self.one_call, self.calls = tagged, f'{tagged} ("\\n" {tagged})*'
            if tool_choice == "required" or isinstance(tool_choice, dict):
                self.at_start = tagged
        rf = response_format if isinstance(response_format, dict) else {}
        schema = None
        if rf.get("type") == "json_schema":
            spec = rf.get("json_schema") if isinstance(rf.get("json_schema"), dict) else {}
            schema = spec.get("schema", {"type": "object"})
            if schema is False:
                raise ValueError("response_format's schema is false: no value is valid")
            schema = schema if isinstance(schema, dict) else {"type": "object"}
        elif rf.get("type") == "json_object":
            schema = {"type": "object"}
        if schema is not None:
            self.value = self.at_start = self.bare = " | ".join(schema_rule(g, schema, 0) for g in self._layouts)
        self._compiled: dict[str, Any] = {}

    @property
    def vocab_size(self) -> int:
        return int(self._ll.vocab_size)

    @property
    def eos_token_id(self) -> int | None:
        """The token llguidance allows where a grammar accepts."""
        eos = getattr(self._ll, "eos_token", None)
        return int(eos) if eos is not None else None

    @property
    def empty(self) -> bool:
        return not self.openings and self.at_start is None and self.bare is None

    def enforced(self, tool_choice: Any, parallel: bool = True) -> str | None:
        """The start rule body a constrained answer must match (None: nothing to enforce).

        ``tool_choice`` required: one or more tagged calls (one when not ``parallel``); named: one call of
        that tool; else a JSON ``response_format``: its value — or, with tools the model may call ("auto"),
        a value or calls."""
        if self.calls is not None and (isinstance(tool_choice, dict) or (tool_choice == "required" and not parallel)):
            return self.one_call
        if self.calls is not None and tool_choice == "required":
            return self.calls
        if self.value is not None:
            return self.value if self.calls is None else f"{self.value} | {self.calls}"
        return None

    def compile(self, body: str) -> tuple[Any, str | None]:
        """The compiled grammar of a start rule body and llguidance's error (None when it compiles)."""
        if body not in self._compiled:
            grammar = self._llguidance.LLMatcher.grammar_from_lark(grammar_text(body, *self._layouts))
            self._compiled[body] = (grammar, self._llguidance.LLMatcher.validate_grammar(grammar, self._ll) or None)
        return self._compiled[body]

    def new_matcher(self, grammar: Any) -> Any:
        return self._llguidance.LLMatcher(self._ll, grammar, log_level=0)

    def matcher(self, body: str) -> Any | None:
        """A fresh matcher for a start rule body, or None if the grammar does not compile."""
        grammar, error = self.compile(body)
        if error is not None:
            return None
        m = self.new_matcher(grammar)
        return None if m.is_error() else m


@register_drafter("grammar")
class GrammarDrafter:
    """Drafts the grammar-forced tokens of tool calls / JSON answers; filters other drafters' proposals.

    The grammar comes from the :class:`DraftContext`'s ``tools``/``tool_choice``/``response_format``
    (compiled once per distinct request shape). ``max_forced`` caps one round's forced run.
    """

    name = "grammar"
    drafts_forced = True

    def __init__(self, tokenizer: Any, max_forced: int = 32, max_grammars: int = 16,
                 grammars: dict[str, ToolCallGrammar | None] | None = None) -> None:
        """``grammars``: a compiled-grammar cache to share with other drafters of the same tokenizer (one
        per sequence, each compiling the same tools otherwise)."""
        if tokenizer is None:
            raise ValueError("GrammarDrafter needs the target's tokenizer")
        self.tokenizer, self.max_forced, self.max_grammars = tokenizer, max_forced, max_grammars
        self._grammars: dict[str, ToolCallGrammar | None] = {} if grammars is None else grammars
        self.reset()

    def reset(self) -> None:
        self._seen: list[int] = []  # committed tokens already followed
        self._matcher: Any = None
        self._grammar: ToolCallGrammar | None = None
        self._key: str | None = None
        self._structure: tuple[Any, Any, Any] = (None, None, None)
        self.left_grammar = 0  # times the committed tokens left an engaged grammar (for statistics)

    # -- following the committed tokens -------------------------------------------------------------

    def sync(self, ctx: DraftContext) -> bool:
        """Follow ``ctx.tokens``; True when a grammar is engaged at the end of them."""
        structure = (ctx.tools, ctx.tool_choice, ctx.response_format)
        if self._key is None or any(x is not y for x, y in zip(structure, self._structure, strict=True)):
            self._structure = structure  # the same request objects every round: serialise only on change
            key = json.dumps(list(structure), sort_keys=True, default=str)
        else:
            key = self._key
        common = common_prefix(self._seen, ctx.tokens)
        if key != self._key or common < len(self._seen) or common < ctx.num_prompt_tokens:
            self._key, self._grammar = key, self._grammar_for(key, ctx)
            self._matcher, self._seen = None, list(ctx.tokens[: ctx.num_prompt_tokens])
            if self._grammar is not None:
                self._matcher = self._engage_at_start(ctx)
        if self._grammar is None:
            self._seen = list(ctx.tokens)
            return False
        for i in range(len(self._seen), len(ctx.tokens)):
            self._step(ctx, i)
        return self._matcher is not None

    def _grammar_for(self, key: str, ctx: DraftContext) -> ToolCallGrammar | None:
        if not ctx.tools and not ctx.response_format:
            return None
        if key not in self._grammars:
            if len(self._grammars) >= self.max_grammars:
                self._grammars.pop(next(iter(self._grammars)))
            try:
                g: ToolCallGrammar | None = ToolCallGrammar(self.tokenizer, ctx.tools, ctx.tool_choice,
                                                            ctx.response_format)
            except Exception as e:  # a schema the grammar builder cannot read: draft without it (lossless)
                log.info("no grammar drafts for this request's tools/response_format: %s", e)
                g = None
            self._grammars[key] = g
        g = self._grammars[key]
        return None if g is None or g.empty else g

    def _engage_at_start(self, ctx: DraftContext) -> Any | None:
        """A matcher for the answer's start: when the prompt ends with an opening (an assistant prefill
        such as ``<tool_call>``), or when ``tool_choice``/``response_format`` demand structure."""
        g = self._grammar
        tail = self.tokenizer.decode(ctx.tokens[max(ctx.num_prompt_tokens - 16, 0) : ctx.num_prompt_tokens])
        for opening in g.openings:
            if tail.endswith(opening.suffix):
                return g.matcher(opening.body)
        return g.matcher(g.at_start) if g.at_start is not None else None

    def _step(self, ctx: DraftContext, i: int) -> None:
        tok = ctx.tokens[i]
        self._seen.append(tok)
        g = self._grammar
        if self._matcher is not None:
            if not self._matcher.consume_token(tok) or self._matcher.is_error():
                self._matcher = None  # the target left the grammar: draft without it
                self.left_grammar += 1
            elif self._matcher.is_stopped():
                self._matcher = None  # the span is complete
            return
        generated = ctx.tokens[ctx.num_prompt_tokens : i + 1]
        tail = self.tokenizer.decode(generated[-16:])  # >= the longest opening, even at a byte per token
        for opening in g.openings:
            if tail.endswith(opening.suffix):
                self._matcher = g.matcher(opening.body)
                return
        if g.bare is not None and len(generated) == 1 and tail.lstrip()[:1] in ("{", "["):
            m = g.matcher(g.bare)
            if m is not None and m.consume_token(tok) and not m.is_error():
                self._matcher = m

    # -- drafting ------------------------------------------------------------------------------------

    def prepare(self, ctx: DraftContext) -> None:
        """Compile the grammar of ``ctx``'s request shape (once per shape; the tokenizer's grammar index once
        per process, about a second for a 150k vocabulary) and follow ``ctx.tokens``: set-up that a caller
        timing its drafting runs first, so that a request's first round is not priced as drafting."""
        self.sync(ctx)

    def forced(self, ctx: DraftContext) -> list[int]:
        """The tokens the grammar forces after ``ctx.tokens`` (empty when no grammar is engaged)."""
        if not self.sync(ctx):
            return []
        return [int(t) for t in self._matcher.compute_ff_tokens()[: self.max_forced]]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` (following the synced context) the engaged grammar allows."""
        if self._matcher is None or not tokens:
            return len(tokens)
        return int(self._matcher.validate_tokens(tokens))

    def propose(self, ctx: DraftContext, k: int) -> DraftProposal:
        forced = self.forced(ctx)
        return DraftProposal(tokens=tuple(forced), source=self.name, num_forced=len(forced))

