"""The verifier's engine: sessions, server-mode generation and the batched round pass, over one target.

Every model call runs on one worker thread (the model is never used concurrently). A request checks
``base_len``, appends the client's ``new_tokens``, then runs one round (edge mode) or rounds until a stop
or its limit (server / server-ar). Batches of rounds reach :meth:`VerifierEngine.execute`: server-mode
items draft, ONE forward pass runs for all (a lone round takes the unbatched path, as the in-process loop
does), and :func:`agentspec.round_step.commit_round` commits each; a fault in one item fails it alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from agentspec import models
from agentspec.constraint import Constraint, ConstraintError, wants_constraint
from agentspec.drafters import DraftContext, Drafter, make_drafter
from agentspec.drafters.base import propose_round
from agentspec.drafters.copy import LEAD, SuffixIndex
from agentspec.drafters.gate import ModelGates
from agentspec.drafters.grammar import warm_grammar_tokenizer
from agentspec.protocol import (
    BASE_LEN_MISMATCH,
    Generate,
    Load,
    OpenSession,
    ProtocolError,
    RoundReply,
    SessionInfo,
    Timings,
    TokenLogprob,
    TopLogprob,
    VerifyRound,
)
from agentspec.round_step import commit_round, observe_round, round_inputs
from agentspec.router import DraftLengthPolicy
from agentspec.text import IncrementalDecoder
from agentspec.toolcalls import normalise_tools, render_chat
from agentspec.types import DraftProposal
from agentspec.verifier_server.config import ServerConfig
from agentspec.verifier_server.kv_store import KVStore, Session, rss_bytes, snapshot
from agentspec.verifier_server.scheduler import BatchScheduler, ItemOutcome, RoundItem, session_guard


class VerifierEngine:
    """Sessions, rounds and generation over one target (and an optional server-side drafter)."""

    def __init__(self, target: models.LoadedModel, config: ServerConfig,
                 draft_model: models.LoadedModel | None = None, metrics: Any = None,
                 executor: ThreadPoolExecutor | None = None) -> None:
        """``executor``: the one-worker thread that runs the model (:func:`models.model_thread`); pass the
        one the target was loaded and warmed on so a single thread ever runs its torch ops."""
        self.target, self.config, self.draft_model = target, config, draft_model
        self.vocab_size = models.vocab_size(target.model)  # no torch op on this (the caller's) thread
        self.store = KVStore(target.model, config.max_sessions, config.kv_cache_memory)
        self.metrics = metrics
        self._owns_executor = executor is None
        self.executor = executor or models.model_thread()
        self.scheduler = BatchScheduler(self, config.max_batch_size, config.batch_window_s)
        self._chunk_s = 0.0  # the last prefill chunk's time (bounds how long a long prefill yields to rounds)
        self.policies: dict[str, DraftLengthPolicy] = {}
        self.copy_index = SuffixIndex()  # past outputs per API key: cross-conversation copy drafting
        self.model_gates = ModelGates()  # per API key: whether the draft model pays inside the default tree
        self.verify_costs: dict[int, float] = {}
        self.flat_draft_tokens: int | None = None  # a round's draft below verify_costs' step
        self.grammar_ready: Any = None  # the warm-up's grammar-tokenizer build
        self.ready = False

    # -- start-up ----------------------------------------------------------------------------------

    def warm_up(self) -> dict[int, float]:
        """Run the model once, measure the verify-cost curve (it seeds the server-mode draft policies).

        Runs on the model thread, where the curve's timings will hold when serving; then the grammar engine's
        tokenizer is built on a thread of its own, so no first tool-calling request waits for it."""
        curve = models.on_thread(self.executor, self._warm_up)
        if self.target.tokenizer is not None:
            self.grammar_ready = warm_grammar_tokenizer(self.target.tokenizer)
        return curve

    def _warm_up(self) -> dict[int, float]:
        curve = models.warm_up_verify_cost(self.target.model, self.vocab_size, self.config.max_draft_tokens + 1,
                                           self.config.max_model_len)
        for name in ("model", "copy"):
            self.policies[name] = DraftLengthPolicy.from_calibration(curve)
        self.verify_costs, self.flat_draft_tokens = curve, models.flat_draft_tokens(curve)
        cache = models.new_cache(self.target.model)
        models.forward(self.target.model, [t % self.vocab_size for t in range(1, 9)], cache, 1)
        self.store.bytes_per_token = -(-models.cache_nbytes(cache) // 8)
        if rss_bytes() is not None:  # freed KV pages go back to the OS only once RSS passes weights + KV cap
            self.store.rss_soft_limit = models.resident_weight_bytes(self.target.model) + self.config.kv_cache_memory
        self.ready = True
        return curve

    def load(self) -> Load:
        return Load(running=self.scheduler.running, waiting=self.scheduler.waiting,
                    sessions=self.store.num_open(), kv_cache_bytes=self.store.used_bytes,
                    kv_cache_capacity_bytes=self.config.kv_cache_memory)

    async def run_on_model(self, fn: Callable[..., Any], *args: Any, background: bool = False) -> Any:
        """``fn(*args)`` on the model thread. ``background``: a long prefill's later chunk, which lets the
        other jobs (rounds, short prefills) go first (:meth:`BatchScheduler.yield_to_others`)."""
        with contextlib.nullcontext() if background else self.scheduler.foreground_job():
            return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    # -- sessions ----------------------------------------------------------------------------------

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
               add_generation_prompt: bool = True) -> list[int]:
        """Chat messages (+ tools) → prompt ids with the target's own chat template."""
        tok = self.target.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ProtocolError("this model has no chat template; send prompt_ids instead", param="messages")
        try:
            return render_chat(tok, messages, tools, add_generation_prompt)
        except Exception as e:  # template errors are the caller's input
            raise ProtocolError(f"could not render messages with the model's chat template: {e}",
                                param="messages") from e

    async def open_session(self, req: OpenSession, owner: str) -> SessionInfo:
        start = time.perf_counter()
        ids = req.prompt_ids if req.prompt_ids is not None else self.render(req.messages, req.tools,
                                                                             req.add_generation_prompt)
        bad = [t for t in ids if t >= self.vocab_size]
        if bad:
            raise ProtocolError(f"prompt_ids has token id {bad[0]} but the vocabulary has {self.vocab_size} ids",
                                param="prompt_ids")
        room = self.config.max_model_len - len(ids)
        if room < 1:
            raise ProtocolError(f"the prompt has {len(ids)} tokens; this server's --max-model-len is "
                                f"{self.config.max_model_len}", param="prompt_ids")
        done = req.num_generated  # a reopened answer: its limit and grammar count from where it began
        max_new = min(req.max_new_tokens or room + done, room + done)
        stops = frozenset(req.stop_token_ids if req.stop_token_ids is not None else self.target.eos_token_ids)
        constraint = await asyncio.to_thread(self._constraint, req, stops, ids[len(ids) - done :])
        t0 = time.perf_counter()
        session, reused = await self._create_and_prefill(owner, ids, max_new, stops)
        session.num_prompt_tokens = len(ids) - done
        session.structure = (req.tools, req.tool_choice, req.response_format)
        session.constraint = constraint
        session.decoder = self._decoder()
        if self.metrics:
            self.metrics.prompt_tokens(len(ids) - reused, reused)
        return self.info(session, reused_tokens=reused, prefill_ms=(time.perf_counter() - t0) * 1e3,
                         server_ms=(time.perf_counter() - start) * 1e3, model=req.model or self.config.served_model_name)

    def _constraint(self, req: OpenSession, stops: frozenset[int], answer: list[int]) -> Constraint | None:
        """The grammar a session's answers are decoded under (None: unconstrained); a 400 if it cannot be."""
        if not wants_constraint(req.tools, req.tool_choice, req.response_format):
            return None
        param = "response_format" if req.response_format and req.response_format.get("type") != "text" else "tools"
        if self.target.tokenizer is None:
            raise ProtocolError("this model has no tokenizer to enforce a grammar with", param=param)
        try:
            constraint = Constraint(self.target.tokenizer, normalise_tools(req.tools), req.tool_choice,
                                    req.response_format, stops, req.parallel_tool_calls)
            constraint.sync(answer, 0)  # a reopened answer must already follow the grammar
            constraint.jump_forward = self.config.jump_forward
        except ConstraintError as e:
            raise ProtocolError(str(e), param=param) from e
        return constraint

    async def _create_and_prefill(self, owner: str, ids: list[int], max_new: int, stops: frozenset[int]
                                  ) -> tuple[Session, int]:
        """A new session with all but the last prompt token cached (its logits come in round 1).

        Each prefill chunk is its own model-thread job, so rounds of other sessions queued meanwhile run
        between chunks: a short request waits for about one chunk, not for a long prompt's whole prefill.
        A prefill that fails or is cancelled (its client left) leaves no session behind."""
        session, reused = await self.run_on_model(self.store.create, owner, ids, max_new, stops)
        session.busy += 1
        try:
            first = True
            while len(ids) - 1 > session.num_cached:
                if not first:  # other requests' model jobs go first, for up to a few chunks' time
                    await self.scheduler.yield_to_others(session.id, max(3 * self._chunk_s, 0.05))
                t0 = time.perf_counter()
                await self.run_on_model(self._prefill_chunk, session, ids, background=not first)
                self._chunk_s, first = time.perf_counter() - t0, False
            await self.run_on_model(self.store.update_size, session)
            self.scheduler.touch(session.id)
        except BaseException:
            self.store.drop(session.id)
            raise
        finally:
            session.busy -= 1
        return session, reused

    def _prefill_chunk(self, session: Session, ids: list[int]) -> None:
        end = min(session.num_cached + max(1, self.config.prefill_chunk_tokens), len(ids) - 1)
        try:
            models.forward(self.target.model, ids[session.num_cached : end], session.cache, 1)
            models.synchronize(self.target.device)  # the chunk's time paces yielding (not its launch)
        except BaseException:
            models.crop_cache(session.cache, session.num_cached)
            raise
        session.num_cached = end

    def info(self, session: Session, **extra: Any) -> SessionInfo:
        """What the client needs to know of a session (``extra``: fields a fresh open adds)."""
        return SessionInfo(**{"session_id": session.id, "prompt_ids": session.tokens[: session.num_prompt_tokens],
                              "committed_len": len(session.tokens), "vocab_size": self.vocab_size,
                              "max_draft_tokens": self.config.max_draft_tokens,
                              "flat_draft_tokens": self.flat_draft_tokens,
                              "stop_token_ids": sorted(session.stop_token_ids),
                              "constrained": session.constraint is not None,
                              "model": self.config.served_model_name, "load": self.load(), **extra})

    # -- rounds ------------------------------------------------------------------------------------

    def _prepare(self, session: Session, base_len: int, new_tokens: list[int]) -> None:
        """Check the client's view of the session and append what it committed; raises on mismatch."""
        if base_len != len(session.tokens):
            raise ProtocolError(
                f"base_len {base_len} does not match the session's committed length {len(session.tokens)}; "
                "resend your prefix in a new session", code=BASE_LEN_MISMATCH, status=409,
                extra={"committed_len": len(session.tokens)})
        if session.finished and not new_tokens:
            raise ProtocolError(f"session {session.id} has finished ({session.finish_reason}); append "
                                "new_tokens to continue it, or open a new session", code="session_finished")
        if len(session.tokens) + len(new_tokens) >= self.config.max_model_len:
            raise ProtocolError(f"new_tokens would take the session past --max-model-len "
                                f"{self.config.max_model_len}", param="new_tokens")
        if new_tokens:
            session.tokens.extend(new_tokens)
            session.num_prompt_tokens = len(session.tokens)  # a new turn: max_new_tokens counts from here
            session.decoder = self._decoder()
            session.finished, session.finish_reason = False, None

    async def verify_round(self, session: Session, req: VerifyRound) -> RoundReply:
        """An edge-mode round: the client's draft, verified (batched with other sessions' rounds)."""
        req.check_against(self.vocab_size, self.config.max_draft_tokens)
        async with session_guard(session):
            restore = snapshot(session)
            try:
                self._prepare(session, req.base_len, req.new_tokens)
                return await self.scheduler.submit(RoundItem(session, req.draft.to_proposal(), req.sampling))
            except Exception:  # not a cancellation: its round may still be running on the model thread
                restore()  # a refused or failed round leaves the session exactly as it was
                raise

    async def generate(self, session: Session, req: Generate) -> AsyncIterator[RoundReply]:
        """Server mode (its own drafter) or server-ar (plain): stream rounds until a stop or the limit."""
        req.check_against(self.vocab_size, self.config.max_draft_tokens)
        if req.mode == "server" and req.drafter == "model" and self.draft_model is None:
            raise ProtocolError('drafter "model" needs a server started with --draft-model; use "default"',
                                param="drafter")  # refused before the session changes at all
        async with session_guard(session):
            restore, rounds = snapshot(session), self._rounds(session, req)
            try:
                self._prepare(session, req.base_len, req.new_tokens)
                first = await rounds.__anext__()
            except Exception:  # not a cancellation: its round may still be running on the model thread
                await rounds.aclose()
                restore()  # nothing was committed yet: the session is left exactly as it was
                raise
            yield first
            async for reply in rounds:
                yield reply

    async def _rounds(self, session: Session, req: Generate) -> AsyncIterator[RoundReply]:
        """``generate``'s rounds, after its ``new_tokens`` were appended."""
        start = session.num_generated
        drafter, policy, gamma = None, None, 0
        if req.mode == "server":
            gamma = req.num_draft_tokens if req.num_draft_tokens is not None else self.config.default_num_draft_tokens
            name = "model" if self.draft_model is not None else "copy"
            if session.drafter is None or session.drafter_kind != req.drafter:
                # kept on the session: its KV cache follows later turns too
                session.drafter, session.drafter_kind = self._server_drafter(req.drafter, session.owner), req.drafter
            drafter = session.drafter
            policy = self.policies.get(name) if req.num_draft_tokens is None else None
        for done in range(1, req.max_new_tokens + 1):  # a round commits a token at least
            left = req.max_new_tokens - (session.num_generated - start)
            round_gamma = min(gamma, left - 1) if gamma > 0 else -1  # -1: no draft at all, not even forced
            item = RoundItem(session, DraftProposal(), req.sampling, drafter, round_gamma, policy)
            reply = await self.scheduler.submit(item, limit=start + req.max_new_tokens)
            if done == req.max_rounds and not reply.finished:  # the request's round budget: over, as at its limit
                reply.finished, reply.finish_reason = True, "length"
            yield reply
            if reply.finished:
                return

    def _server_drafter(self, kind: str, owner: str) -> Drafter:
        """A new server-mode drafter of ``kind`` (``Generate.drafter``) for a session of ``owner``."""
        model = make_drafter("model", model=self.draft_model) if self.draft_model is not None else None
        kwargs = {"ngram": {}, "model": {"model": self.draft_model},
                  "default": {"tokenizer": self.target.tokenizer, "model": model, "index": self.copy_index,
                              "verify_costs": self.verify_costs,
                              "gate": self.model_gates.get(owner) if model is not None else None}}[kind]
        return make_drafter(kind, **kwargs)

    # -- the model thread --------------------------------------------------------------------------

    def execute(self, items: list[RoundItem], limits: list[int | None]) -> list[ItemOutcome]:
        """Draft (server mode), one forward pass for all items, commit each. Runs on the model thread.

        An item whose drafting or commit raises gets that error alone; the others go on."""
        outcomes = [ItemOutcome() for _ in items]
        draft_s = [0.0] * len(items)
        for i, item in enumerate(items):
            if item.drafter is not None and item.num_draft_tokens >= 0:
                t0 = time.perf_counter()
                try:
                    item.draft = self._server_draft(item)
                except Exception as e:  # e.g. a tools schema the grammar engine rejects: this item only
                    outcomes[i].error = e
                draft_s[i] = time.perf_counter() - t0
        live = [i for i, out in enumerate(outcomes) if out.error is None]
        t0 = time.perf_counter()
        model = self.target.model
        inputs = [round_inputs(items[i].session, items[i].draft, model, batched=len(live) > 1) for i in live]
        try:
            if len(live) == 1:  # all model calls run on the single model thread: no lock needed
                x, d = inputs[0], items[live[0]].draft
                rows = [models.forward(model, x.ids, items[live[0]].session.cache, len(d) + 1, x.mask, x.positions)]
            elif live:
                full = models.forward_batch(model, [items[i].session.cache for i in live], [x.ids for x in inputs],
                                            [x.mask for x in inputs], [x.positions for x in inputs])
                rows = [r[x.num_pending - 1 :] for r, x in zip(full, inputs, strict=True)]
        except BaseException:  # the pass failed: no session keeps positions it may have appended
            for i in live:
                models.crop_cache(items[i].session.cache, items[i].session.num_cached)
            raise
        verify_s = time.perf_counter() - t0
        for j, i in enumerate(live):
            s, committed = items[i].session, len(items[i].session.tokens)
            try:
                outcomes[i].reply = self._finish_round(items[i], rows[j], inputs[j].num_pending, verify_s,
                                                       draft_s[i], len(live), limits[i])
            except Exception as e:  # one bad item must not fail the others
                if len(s.tokens) == committed:  # nothing committed: drop the KV positions the pass appended
                    models.crop_cache(s.cache, s.num_cached)
                outcomes[i].error = e
        return outcomes

    def _server_draft(self, item: RoundItem) -> DraftProposal:
        gamma, s = item.num_draft_tokens, item.session
        gate = getattr(item.drafter, "gate", None)
        if item.policy is not None and gate is not None and not gate.pays:  # a grammar + copy round: their γ
            item.policy = self.policies.get("copy", item.policy)
        if item.policy is not None and gamma > 0:
            gamma = item.policy.choose(gamma)
        tools, tool_choice, response_format = s.structure
        ctx = DraftContext(s.tokens, s.num_prompt_tokens, item.sampling.to_params(), s.rng(item.sampling),
                           tools=tools, tool_choice=tool_choice, response_format=response_format, index_key=s.owner,
                           constraint=s.constraint)
        return propose_round(item.drafter, ctx, gamma).head(self.flat_draft_tokens or self.config.max_draft_tokens)

    def _finish_round(self, item: RoundItem, logits: torch.Tensor, num_pending: int, verify_s: float,
                      draft_s: float, batch_size: int, limit: int | None) -> RoundReply:
        s, d = item.session, item.draft
        session_cap = min(s.num_prompt_tokens + s.max_new_tokens, self.config.max_model_len)
        cap = session_cap if limit is None else min(session_cap, s.num_prompt_tokens + limit)
        out = commit_round(s, d, logits, num_pending, item.sampling.to_params(),
                           s.rng(item.sampling), cap)
        new, finish = out.tokens, out.finish_reason
        # the session ends at a stop or its own cap; a generate request's own limit only ends that request
        session_done = finish == "stop" or len(s.tokens) >= session_cap
        s.finished, s.finish_reason = session_done, finish if session_done else None
        if finish is not None:  # a finished answer feeds cross-conversation copy drafting (per API key)
            start = s.num_prompt_tokens
            self.copy_index.add(s.tokens[start:], s.owner, lead=s.tokens[max(start - LEAD, 0) : start])
        s.last_used = time.monotonic()
        self.store.update_size(s)
        if item.policy is not None:  # the copy policy is not charged for a gated model's probes
            model_s = getattr(item.drafter, "last_model_s", 0.0) if item.policy is self.policies.get("copy") else 0.0
            observe_round(item.policy, d, out, verify_s if batch_size == 1 else None, draft_s - model_s)
        if self.metrics:
            self.metrics.round(len(d), out.num_accepted, len(new), verify_s,
                               "server" if item.drafter is not None else "edge" if len(d) else "server-ar")
        queue_ms = max(0.0, (time.perf_counter() - item.enqueued - verify_s - draft_s) * 1e3)
        text = s.decoder.add(new, final=finish is not None) if s.decoder is not None else ""
        return RoundReply(session_id=s.id, accepted=min(out.num_accepted, len(new)), drafted=len(d),
                          tokens=new, text=text, committed_len=len(s.tokens),
                          finished=finish is not None, session_finished=session_done, finish_reason=finish,
                          logprobs=None if out.logprobs is None else self._logprobs(new, out.logprobs),
                          timings=Timings(queue_ms=queue_ms, verify_ms=verify_s * 1e3, draft_ms=draft_s * 1e3,
                                          batch_size=batch_size), load=self.load())

    def _logprobs(self, tokens: list[int], lps: list[tuple[float, list[tuple[int, float]]]]) -> list[TokenLogprob]:
        tok = self.target.tokenizer
        text = (lambda t: tok.decode([t])) if tok is not None else str
        return [TokenLogprob(token=t, text=text(t), logprob=lp,
                             top=[TopLogprob(token=i, text=text(i), logprob=v) for i, v in top])
                for t, (lp, top) in zip(tokens, lps, strict=True)]

    def _decoder(self) -> IncrementalDecoder | None:
        """A session's text decoder for the tokens generated from now on."""
        return IncrementalDecoder(self.target.tokenizer) if self.target.tokenizer is not None else None

    def shutdown(self) -> None:
        if self._owns_executor:
            self.executor.shutdown(wait=False, cancel_futures=True)
