"""One request's state, independent of sync/async I/O: what is committed and what it means.

:class:`Run` holds the committed tokens, session id, tool-call parser, stop-string hold-back and finish
reason; it builds the wire requests and applies each ``RoundReply``, returning the events made final.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from agentspec.client.events import ClientStats, FinalEvent, TextEvent, ToolCallEvent
from agentspec.drafters.base import Drafter
from agentspec.protocol import Draft, Generate, OpenSession, RoundReply, Sampling, SessionInfo, VerifyRound
from agentspec.text import StopStrings
from agentspec.toolcalls import ToolCallParser
from agentspec.types import DraftProposal, SamplingParams, Taken


class Run:
    """The state of one request; ``drafter`` is its local drafter (None: no edge rounds)."""

    def __init__(self, messages: list[dict], tools: list[dict] | None, max_tokens: int, sampling: SamplingParams,
                 stop: Sequence[str], mode: str, drafter: Drafter | None, tool_choice: Any = None,
                 response_format: dict[str, Any] | None = None, model: str | None = None) -> None:
        self.messages, self.tools, self.model, self.drafter = messages, tools, model, drafter
        self.tool_choice, self.response_format = tool_choice, response_format
        self.max_tokens, self.sampling, self.stop, self.mode = max_tokens, sampling, list(stop), mode
        self.wire_sampling = Sampling.from_params(sampling)
        self.prompt: list[int] = []
        self.tokens: list[int] = []  # prompt + generated, as committed
        self.sid: str | None = None
        self.text, self.stops = "", StopStrings(stop)
        # every committed text, before stop strings and the tool-call parser: what the API fallback continues
        # (``text`` lacks what they hold back, a stop string's possible start or an unfinished tool call)
        self.committed_text = ""
        self.parser = ToolCallParser(tools_enabled=bool(tools))
        self.calls: list[ToolCallEvent] = []
        self.finish: str | None = None
        self.stats = ClientStats()
        self.verifier = 0  # index into client.transports
        self.served_model: str | None = None  # the name the verifier answered as (its SessionInfo)
        # the API fallback's answer: the provider's model name and usage (None: no API segment ran)
        self.api_model: str | None = None
        self.api_usage: dict[str, int] | None = None
        # OpenAI-form logprobs of the answer's tokens, when the sampling settings ask (stop tokens left out)
        self.logprobs: list[dict[str, Any]] | None = [] if sampling.logprobs is not None else None
        self.stop_token_ids: frozenset[int] = frozenset()
        # pipelined edge drafting: (the tokens it assumed committed, the draft after them)
        self.ahead: tuple[tuple[int, ...], DraftProposal] | None = None
        self.shadowed_to = 0  # auto: tokens up to here were replayed for the router's edge shadow (EdgeDrafting)
        self.constrained = False  # the verifier decodes this answer under its grammar (SessionInfo)
        # the most an edge round sends: the verifier's cap, or less where its pass cost steps up (SessionInfo)
        self.flat_draft_tokens = 16
        self.parallel_tool_calls = True  # False: a constrained answer holds one tool call
        self.constraint: Any = None  # the client's copy of that grammar (edge drafts respect it); False: none
        self.excluded: frozenset[str] = frozenset()  # modes the router must not pick for this answer
        self.round_kind = "text"  # what the last committed round counts as for the router (apply)
        self.whole: str | None = None  # why the vllm mode decodes this answer as one chat completion

    @property
    def generated(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def kind(self) -> str:
        """``"tool"`` inside a tool call's (or JSON answer's) JSON, else ``"text"`` (router estimates)."""
        structured = isinstance(self.response_format, dict) and self.response_format.get("type") != "text"
        return "tool" if structured or self.parser.in_structure else "text"

    def open_request(self) -> dict[str, Any]:
        """The session to open: the chat messages at first, else the committed prefix (and tools again)."""
        first = self.sid is None and not self.prompt
        if first:
            source: dict[str, Any] = {"messages": self.messages, "max_new_tokens": self.max_tokens}
        else:  # the answer so far goes along as such: its grammar and limit count from where it began
            source = {"prompt_ids": self.tokens, "num_generated": self.generated, "max_new_tokens": self.max_tokens}
        return OpenSession(**source, tools=self.tools, tool_choice=self.tool_choice,
                           response_format=self.response_format, parallel_tool_calls=self.parallel_tool_calls,
                           model=self.model).to_wire()

    def opened(self, info: SessionInfo) -> None:
        if not self.prompt:
            self.prompt = list(info.prompt_ids)
            self.tokens = list(self.prompt)
        self.sid = info.session_id
        self.served_model = info.model
        self.stop_token_ids = frozenset(info.stop_token_ids)
        self.constrained = info.constrained
        self.flat_draft_tokens = min(info.flat_draft_tokens or info.max_draft_tokens, info.max_draft_tokens)

    def round_request(self, proposal: DraftProposal) -> dict[str, Any]:
        """An edge round verifying ``proposal`` after the committed tokens."""
        return VerifyRound(base_len=len(self.tokens), draft=Draft.from_proposal(proposal),
                           sampling=self.wire_sampling).to_wire()

    def generate_request(self, mode: str, max_new_tokens: int, drafter: str, max_rounds: int | None = None
                         ) -> dict[str, Any]:
        """A server-side segment (``server`` drafting with ``drafter``, or ``server-ar``) of at most
        ``max_new_tokens`` tokens and ``max_rounds`` rounds (None: no round limit)."""
        return Generate(base_len=len(self.tokens), mode=mode, sampling=self.wire_sampling,
                        max_new_tokens=max_new_tokens, max_rounds=max_rounds,
                        drafter=drafter if mode == "server" else "default").to_wire()

    def taken(self, prop: DraftProposal, reply: RoundReply) -> Taken:
        """What the target took of an edge round's draft ``prop`` (before :meth:`apply`), for the router: its
        γ (the free positions of its main path: what the policy chose, sibling leaves and forced tokens riding
        along) and its free positions along the target's path (γ, reached, accepted); and the survival of
        its main path and of the guess after it that this round's draft ahead made, if any (reached,
        accepted)."""
        spine = len(prop.spine())
        ahead = self.ahead[0] if self.ahead is not None else ()
        guess = ahead[-1] if len(ahead) == len(self.tokens) + spine + 1 else None
        _, reached, accepted = prop.free_acceptance(prop.depth_along(reply.tokens, reply.accepted), reply.accepted)
        return (spine - prop.num_forced, reached, accepted), prop.spine_acceptance(reply.tokens, guess)

    def apply(self, reply: RoundReply) -> list[Any]:
        """Commit a round's tokens; return the events they make final. Sets :attr:`round_kind`."""
        before = self.kind
        self.tokens.extend(reply.tokens)
        if self.logprobs is not None and self.finish is None:
            self.logprobs += [x.openai() for x in reply.logprobs or () if x.token not in self.stop_token_ids]
        events = self.feed_text(reply.text)
        if reply.session_finished or (reply.finished and reply.finish_reason == "stop"):
            self.finish = reply.finish_reason or "stop"
        # the kind the router counts the round in: "tool" where it drafted or committed inside JSON. A round
        # that opens a call's JSON ("```json\n{") copies boilerplate as well as any argument: counted as
        # prose, it made a mode look good for the prose of the answer that follows a tool result
        self.round_kind = "tool" if "tool" in (before, self.kind) else "text"
        return events

    def feed_text(self, text: str) -> list[Any]:
        """Committed text through the stop strings and the tool-call parser: the events it makes final."""
        self.committed_text += text
        text = self.stops.feed(text)
        if self.stops.stopped:
            self.finish = "stop"
        return self._parse(self.parser.feed(text))

    def close_events(self) -> list[Any]:
        return self._parse(self.parser.feed(self.stops.flush()) + self.parser.finish())

    def add_call(self, call_id: str, name: str, arguments: str) -> ToolCallEvent:
        call = ToolCallEvent(len(self.calls), call_id, name, arguments)
        self.calls.append(call)
        return call

    def _parse(self, parsed: list[Any]) -> list[Any]:
        out: list[Any] = []
        for ev in parsed:
            if ev.call is not None:
                out.append(self.add_call(ev.call.id, ev.call.name, ev.call.arguments))
            elif ev.text:
                self.text += ev.text
                out.append(TextEvent(ev.text))
        return out

    def final(self) -> FinalEvent:
        finish = "tool_calls" if self.calls and self.finish == "stop" else self.finish or "length"
        usage = {"prompt_tokens": len(self.prompt), "completion_tokens": self.generated,
                 "total_tokens": len(self.tokens)}
        if self.api_usage is not None:  # a switch to the API mid-answer: both parts were processed and billed
            usage = {k: usage[k] + self.api_usage.get(k, 0) for k in usage}
        # the model that answered: the API model once it took over, else the verifier's served name
        model = self.api_model or self.served_model or self.model
        generated = self.tokens[len(self.prompt) :]
        return FinalEvent(self.text, generated, list(self.calls), finish, usage, self.stats, model, self.logprobs)
