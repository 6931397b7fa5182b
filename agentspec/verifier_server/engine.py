"""The verifier's engine: session rounds, batched across sessions, on one model thread.

* Every model call (prefill, drafting, verification) runs on a single worker thread, so the model is
  never used concurrently and rounds queue up naturally while a pass runs.
* :class:`BatchScheduler` collects rounds while several sessions are active — until each has a round
  queued, ``max_batch_size``, or an adaptive window (a fraction of the measured pass) — and runs them as
  ONE forward pass (:func:`agentspec.models.forward_batch`); a lone
  round takes the unbatched path, exactly like the in-process engine.
* A round: check ``base_len``, append the client's ``new_tokens``, optionally draft (server mode), run
  the pass over uncached committed tokens + draft nodes, verify (:mod:`agentspec.verify`), keep the
  accepted path in the KV cache, append accepted + recovered/bonus tokens, stop on stop tokens/length.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from agentspec import models
from agentspec.drafters.base import DraftContext, Drafter, observed_acceptance, propose_round
from agentspec.drafters.copy import LEAD, SuffixIndex
from agentspec.drafters.model import ModelDrafter
from agentspec.drafters.ngram import NgramDrafter
from agentspec.drafters.tree import default_drafter
from agentspec.protocol import (
    BASE_LEN_MISMATCH,
    Draft,
    Generate,
    Load,
    OpenSession,
    ProtocolError,
    RoundReply,
    Sampling,
    SessionInfo,
    SparseQ,
    Timings,
    VerifyRound,
)
from agentspec.router import DraftLengthPolicy
from agentspec.toolcalls import render_chat
from agentspec.types import DraftProposal, SamplingParams, SparseDist
from agentspec.verifier_server.kv_store import KVStore, Session, rss_bytes
from agentspec.verify import path_depth, sampling_probs, tree_attention, verify_greedy, verify_sampled


@dataclass
class ServerConfig:
    """Limits and knobs of one verifier (the CLI's flags)."""

    served_model_name: str = "agentspec"
    model_aliases: tuple[str, ...] = ()  # more names requests may use for the same target (vLLM-style)
    max_sessions: int = 64
    kv_cache_memory: int = 2 * 1024**3
    max_model_len: int = 8192
    max_draft_tokens: int = 16
    max_batch_size: int = 8
    batch_window_s: float = 0.002
    default_num_draft_tokens: int = 6
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 1024**2
    prefill_chunk_tokens: int = 512  # long prompts are prefilled in chunks: bounded activation memory
    request_timeout_s: float = 600.0
    # idle HTTP keep-alive: longer than the client's (agentspec.transport.KEEPALIVE_EXPIRY_S, 60 s), so
    # the server never closes a connection the client is about to reuse (uvicorn's own default is 5 s)
    keep_alive_s: float = 75.0

    @property
    def served_names(self) -> tuple[str, ...]:
        """Every name this verifier answers to: the served model name first, then its aliases."""
        return (self.served_model_name, *self.model_aliases)


@dataclass
class _Item:
    """One round waiting for the model thread."""

    session: Session
    draft: DraftProposal
    sampling: Sampling
    drafter: Drafter | None = None  # server mode: draft on the model thread first
    num_draft_tokens: int = 0
    policy: DraftLengthPolicy | None = None
    enqueued: float = field(default_factory=time.perf_counter)
    future: asyncio.Future | None = None


@dataclass
class _Outcome:
    reply: RoundReply | None = None
    error: BaseException | None = None


class VerifierEngine:
    """Sessions, rounds and generation over one target (and an optional server-side drafter)."""

    def __init__(self, target: models.LoadedModel, config: ServerConfig,
                 draft_model: models.LoadedModel | None = None, metrics: Any = None,
                 executor: ThreadPoolExecutor | None = None) -> None:
        """``executor``: the one-worker thread that runs the model (:func:`models.model_thread`); pass the
        one the target was loaded and warmed on so a single thread ever runs its torch ops."""
        self.target = target
        self.config = config
        self.draft_model = draft_model
        self.vocab_size = models.vocab_size(target.model)  # no torch op on this (the caller's) thread
        self.store = KVStore(target.model, config.max_sessions, config.kv_cache_memory)
        self.metrics = metrics
        self._owns_executor = executor is None
        self.executor = executor or models.model_thread()
        self.scheduler = BatchScheduler(self, config.max_batch_size, config.batch_window_s)
        self.policies: dict[str, DraftLengthPolicy] = {}
        self.copy_index = SuffixIndex()  # past outputs per API key: cross-conversation copy drafting
        self.verify_costs: dict[int, float] = {}
        self.ready = False

    # -- start-up ----------------------------------------------------------------------------------

    def warm_up(self) -> dict[int, float]:
        """Run the model once, measure the verify-cost curve (it seeds the server-mode draft policies).

        Runs on the model thread, where the curve's timings will hold when serving."""
        return models.on_thread(self.executor, self._warm_up)

    def _warm_up(self) -> dict[int, float]:
        ids = [t % self.vocab_size for t in range(1, 33)]
        curve = models.measure_verify_cost(self.target.model, ids, self.config.max_draft_tokens + 1, reps=1)
        for name in ("model", "copy"):
            self.policies[name] = DraftLengthPolicy.from_calibration(curve)
        self.verify_costs = curve
        cache = models.new_cache(self.target.model)
        models.forward(self.target.model, ids[:8], cache, 1)
        self.store.bytes_per_token = -(-models.cache_nbytes(cache) // 8)
        if rss_bytes() is not None:  # freed KV pages go back to the OS only once RSS passes weights + KV cap
            self.store.rss_soft_limit = models.resident_weight_bytes(self.target.model) + self.config.kv_cache_memory
        self.ready = True
        return curve

    def load(self) -> Load:
        return Load(running=self.scheduler.running, waiting=self.scheduler.waiting,
                    sessions=self.store.num_open(), kv_cache_bytes=self.store.used_bytes,
                    kv_cache_capacity_bytes=self.config.kv_cache_memory)

    async def run_on_model(self, fn: Callable[..., Any], *args: Any) -> Any:
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
        max_new = min(req.max_new_tokens or room, room)
        stops = frozenset(req.stop_token_ids if req.stop_token_ids is not None else self.target.eos_token_ids)
        t0 = time.perf_counter()
        session, reused = await self.run_on_model(self._create_and_prefill, owner, ids, max_new, stops)
        session.structure = (req.tools, req.tool_choice, req.response_format)
        if self.metrics:
            self.metrics.prompt_tokens(len(ids) - reused, reused)
        return SessionInfo(session_id=session.id, prompt_ids=ids, committed_len=len(session.tokens),
                           reused_tokens=reused, prefill_ms=(time.perf_counter() - t0) * 1e3,
                           vocab_size=self.vocab_size, max_draft_tokens=self.config.max_draft_tokens,
                           model=req.model or self.config.served_model_name, load=self.load())

    def _create_and_prefill(self, owner: str, ids: list[int], max_new: int, stops: frozenset[int]
                            ) -> tuple[Session, int]:
        session, reused = self.store.create(owner, ids, max_new, stops)
        session.busy += 1
        try:
            chunk = max(1, self.config.prefill_chunk_tokens)
            while len(ids) - 1 > session.num_cached:  # cache all but the last token (its logits come in round 1)
                end = min(session.num_cached + chunk, len(ids) - 1)
                models.forward(self.target.model, ids[session.num_cached : end], session.cache, 1)
                session.num_cached = end
        finally:
            session.busy -= 1
        self.store.update_size(session)
        return session, reused

    def info(self, session: Session) -> SessionInfo:
        return SessionInfo(session_id=session.id, prompt_ids=session.tokens[: session.num_prompt_tokens],
                           committed_len=len(session.tokens), vocab_size=self.vocab_size,
                           max_draft_tokens=self.config.max_draft_tokens, model=self.config.served_model_name,
                           load=self.load())

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
            session.text_sent = 0
            session.finished, session.finish_reason = False, None

    async def verify_round(self, session: Session, req: VerifyRound) -> RoundReply:
        """An edge-mode round: the client's draft, verified (batched with other sessions' rounds)."""
        req.check_against(self.vocab_size, self.config.max_draft_tokens)
        async with _session_guard(session):
            self._prepare(session, req.base_len, req.new_tokens)
            return await self.scheduler.submit(_Item(session, _proposal(req.draft), req.sampling))

    async def generate(self, session: Session, req: Generate) -> AsyncIterator[RoundReply]:
        """Server mode (its own drafter) or server-ar (plain): stream rounds until a stop or the limit."""
        req.check_against(self.vocab_size, self.config.max_draft_tokens)
        async with _session_guard(session):
            self._prepare(session, req.base_len, req.new_tokens)
            start = session.num_generated
            drafter, policy, k = None, None, 0
            if req.mode == "server":
                k = req.num_draft_tokens if req.num_draft_tokens is not None else self.config.default_num_draft_tokens
                name = "model" if self.draft_model is not None else "copy"
                if req.drafter == "model" and self.draft_model is None:
                    raise ProtocolError('drafter "model" needs a server started with --draft-model; '
                                        'use "default"', param="drafter")
                if session.drafter is None or session.drafter_kind != req.drafter:
                    # kept on the session: its KV cache follows later turns too
                    session.drafter, session.drafter_kind = self._server_drafter(req.drafter), req.drafter
                drafter = session.drafter
                policy = self.policies.get(name) if req.num_draft_tokens is None else None
            while True:
                left = req.max_new_tokens - (session.num_generated - start)
                k_round = min(k, left - 1) if k > 0 else -1  # -1: no draft at all, not even forced tokens
                item = _Item(session, DraftProposal(), req.sampling, drafter, k_round, policy)
                reply = await self.scheduler.submit(item, limit=start + req.max_new_tokens)
                yield reply
                if reply.finished:
                    return

    def _server_drafter(self, kind: str) -> Drafter:
        """A new server-mode drafter of ``kind`` (``Generate.drafter``)."""
        if kind == "ngram":
            return NgramDrafter()
        model = ModelDrafter(self.draft_model) if self.draft_model is not None else None
        if kind == "model" and model is not None:
            return model
        return default_drafter(self.target.tokenizer, model, self.copy_index, self.verify_costs)

    # -- the model thread --------------------------------------------------------------------------

    def execute(self, items: list[_Item], limits: list[int | None]) -> list[_Outcome]:
        """Draft (server mode), one forward pass for all items, verify each. Runs on the model thread."""
        outcomes = [_Outcome() for _ in items]
        draft_s = [0.0] * len(items)
        for i, item in enumerate(items):
            if item.drafter is not None and item.num_draft_tokens >= 0:
                k = item.num_draft_tokens
                if item.policy is not None and k > 0:
                    k = item.policy.choose(k)
                t0 = time.perf_counter()
                s = item.session
                tools, tool_choice, response_format = s.structure
                ctx = DraftContext(s.tokens, s.num_prompt_tokens, _sampling_params(item.sampling),
                                   self._generator(s, item.sampling), tools=tools, tool_choice=tool_choice,
                                   response_format=response_format, index_key=s.owner)
                item.draft = propose_round(item.drafter, ctx, k)
                draft_s[i] = time.perf_counter() - t0
        t0 = time.perf_counter()
        inputs, masks, positions, pendings = [], [], [], []
        for item in items:
            s, d = item.session, item.draft
            pending = s.tokens[s.num_cached :]
            mask, pos = tree_attention(d.parent_list(), s.num_cached, len(pending), self.target.dtype,
                                       self.target.model.device)
            inputs.append(pending + list(d.tokens))
            masks.append(mask)
            positions.append(pos)
            pendings.append(len(pending))
        if len(items) == 1:  # all model calls run on the single model thread: no lock needed
            item, d = items[0], items[0].draft
            rows = [models.forward(self.target.model, inputs[0], item.session.cache, len(d) + 1,
                                   masks[0] if d.is_tree else None, positions[0] if d.is_tree else None)]
        else:
            full = models.forward_batch(self.target.model, [it.session.cache for it in items], inputs,
                                        masks, positions)
            rows = [r[p - 1 :] for r, p in zip(full, pendings, strict=True)]
        verify_s = time.perf_counter() - t0
        for i, item in enumerate(items):
            try:
                outcomes[i].reply = self._finish_round(item, rows[i], pendings[i], verify_s, draft_s[i],
                                                       len(items), limits[i])
            except Exception as e:  # one bad item must not fail the others
                outcomes[i].error = e
        return outcomes

    def _finish_round(self, item: _Item, logits: torch.Tensor, num_pending: int, verify_s: float,
                      draft_s: float, batch_size: int, limit: int | None) -> RoundReply:
        s, d = item.session, item.draft
        parents = d.parent_list()
        if item.sampling.greedy:
            result = verify_greedy(logits, d.tokens, parents, s.stop_token_ids)
        else:
            probs = sampling_probs(logits, _sampling_params(item.sampling))
            result = verify_sampled(probs, d.tokens, d.draft_probs, parents, self._generator(s, item.sampling),
                                    s.stop_token_ids)
        prefix = s.num_cached + num_pending
        models.keep_cache_positions(s.cache, prefix, [prefix + i for i in result.accepted_nodes])
        s.num_cached = prefix + result.num_accepted
        new = list(result.output_tokens)
        finish = None
        for i, tok in enumerate(new):
            if tok in s.stop_token_ids:
                new, finish = new[: i + 1], "stop"
                break
        session_cap = min(s.num_prompt_tokens + s.max_new_tokens, self.config.max_model_len)
        cap = session_cap if limit is None else min(session_cap, s.num_prompt_tokens + limit)
        if finish is None and len(s.tokens) + len(new) >= cap:
            new, finish = new[: max(cap - len(s.tokens), 0)], "length"
        s.tokens.extend(new)
        if s.num_cached > len(s.tokens) - 1:  # accepted tokens cut by a stop/limit: the last one stays pending
            models.crop_cache(s.cache, len(s.tokens) - 1)
            s.num_cached = len(s.tokens) - 1
        # the session ends at a stop or its own cap; a generate request's own limit only ends that request
        session_done = finish == "stop" or len(s.tokens) >= session_cap
        s.finished, s.finish_reason = session_done, finish if session_done else None
        if finish is not None:  # a finished answer feeds cross-conversation copy drafting (per API key)
            start = s.num_prompt_tokens
            self.copy_index.add(s.tokens[start:], s.owner, lead=s.tokens[max(start - LEAD, 0) : start])
        s.last_used = time.monotonic()
        self.store.update_size(s)
        if item.policy is not None:
            reached = path_depth(parents, result)
            free, reached, accepted = observed_acceptance(d, reached, result.num_accepted)
            item.policy.observe(free, reached, accepted, verify_s if batch_size == 1 else None, draft_s,
                                pass_tokens=len(d))
        if self.metrics:
            self.metrics.round(len(d), result.num_accepted, len(new), verify_s,
                               "server" if item.drafter is not None else "edge" if len(d) else "server-ar")
        queue_ms = max(0.0, (time.perf_counter() - item.enqueued - verify_s - draft_s) * 1e3)
        return RoundReply(session_id=s.id, accepted=min(result.num_accepted, len(new)), drafted=len(d),
                          tokens=new, text=self._text_delta(s, finish is not None), committed_len=len(s.tokens),
                          finished=finish is not None, session_finished=session_done,
                          finish_reason=finish,
                          timings=Timings(queue_ms=queue_ms, verify_ms=verify_s * 1e3, draft_ms=draft_s * 1e3,
                                          batch_size=batch_size),
                          load=self.load())

    def _text_delta(self, s: Session, final: bool) -> str:
        tok = self.target.tokenizer
        if tok is None:
            return ""
        text = tok.decode(s.tokens[s.num_prompt_tokens :], skip_special_tokens=True)
        if text.endswith("\ufffd") and not final:
            return ""  # a multi-byte character split across rounds: wait for the rest
        delta, s.text_sent = text[s.text_sent :], len(text)
        return delta

    def _generator(self, session: Session, sampling: Sampling) -> torch.Generator | None:
        if sampling.greedy:
            return None
        if session.generator is None or sampling.seed is not None and session.seed != sampling.seed:
            session.generator = torch.Generator().manual_seed(
                sampling.seed if sampling.seed is not None else torch.seed())
            session.seed = sampling.seed
        return session.generator

    def shutdown(self) -> None:
        if self._owns_executor:
            self.executor.shutdown(wait=False, cancel_futures=True)


class BatchScheduler:
    """Collects rounds from concurrent requests and runs them in batches on the model thread."""

    def __init__(self, engine: VerifierEngine, max_batch_size: int, window_s: float,
                 window_frac: float = 0.25, max_window_s: float = 0.05) -> None:
        self.engine, self.max_batch_size, self.window_s = engine, max(1, max_batch_size), window_s
        self.window_frac, self.max_window_s = window_frac, max(max_window_s, window_s)
        self._queue: list[tuple[_Item, int | None]] = []
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None
        self.running = 0
        self._recent: dict[str, float] = {}  # session id -> last submit time
        self._pass_s = 0.0  # EMA of one model pass (sets how long waiting for company may take)

    def _active(self, horizon_s: float = 0.25) -> set[str]:
        """Sessions that submitted a round or got a reply lately (their clients are likely to send the next
        one soon). Counting from the reply matters: from the submit, a pass longer than the horizon would
        drop every session of the last batch, and batches would split for good."""
        now = time.perf_counter()
        for sid in [sid for sid, t in self._recent.items() if now - t > horizon_s]:
            del self._recent[sid]
        return set(self._recent)

    def window(self) -> float:
        """How long a batch may wait for the other active sessions' rounds: a fraction of a model pass
        (their clients' turnaround is usually much shorter), at least the configured window."""
        if self.window_s <= 0:
            return 0.0
        return min(self.max_window_s, max(self.window_s, self.window_frac * self._pass_s))

    @property
    def waiting(self) -> int:
        return len(self._queue)

    async def submit(self, item: _Item, limit: int | None = None) -> RoundReply:
        loop = asyncio.get_running_loop()
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = loop.create_task(self._loop())
        item.future = loop.create_future()
        item.enqueued = time.perf_counter()
        self._recent[item.session.id] = item.enqueued
        self._queue.append((item, limit))
        self._wake.set()
        outcome: _Outcome = await item.future
        if outcome.error is not None:
            raise outcome.error
        return outcome.reply

    async def _gather_company(self) -> None:
        """Wait (up to :meth:`window`) until every active session has a round queued or the batch is full.
        A lone client never waits."""
        active = self._active()
        if len(active) < 2 or len(self._queue) >= self.max_batch_size:
            return
        deadline = time.perf_counter() + self.window()
        while len(self._queue) < self.max_batch_size and not active <= {it.session.id for it, _ in self._queue}:
            left = deadline - time.perf_counter()
            if left <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            if not self._queue:
                continue
            while self._queue:
                await self._gather_company()
                batch, self._queue = self._queue[: self.max_batch_size], self._queue[self.max_batch_size :]
                items = [b[0] for b in batch]
                self.running = len(items)
                for it in items:
                    it.session.busy += 1
                t0 = time.perf_counter()
                try:
                    outcomes = await self.engine.run_on_model(self.engine.execute, items, [b[1] for b in batch])
                except Exception as e:  # the whole pass failed: every item gets the error
                    outcomes = [_Outcome(error=e) for _ in items]
                finally:
                    for it in items:
                        it.session.busy -= 1
                    self.running = 0
                elapsed = time.perf_counter() - t0
                self._pass_s = elapsed if self._pass_s == 0 else 0.8 * self._pass_s + 0.2 * elapsed
                done = time.perf_counter()
                for it, out in zip(items, outcomes, strict=True):
                    self._recent[it.session.id] = done  # its client is about to send the next round
                    if not it.future.done():
                        it.future.set_result(out)


class _session_guard:
    """One request at a time per session (a second one waits; it then sees the new committed length)."""

    def __init__(self, session: Session) -> None:
        self.session = session

    async def __aenter__(self) -> None:
        if self.session.async_lock is None:
            self.session.async_lock = asyncio.Lock()
        await self.session.async_lock.acquire()
        self.session.busy += 1

    async def __aexit__(self, *exc: object) -> None:
        self.session.busy -= 1
        self.session.async_lock.release()


def _proposal(draft: Draft) -> DraftProposal:
    probs = None
    if draft.q is not None:
        probs = tuple(_sparse(q) for q in draft.q)
    parents = tuple(draft.parents) if draft.parents is not None else None
    return DraftProposal(tokens=tuple(draft.tokens), parents=parents, draft_probs=probs, source=draft.source)


def _sparse(q: SparseQ) -> SparseDist:
    return SparseDist(ids=tuple(q.ids), probs=tuple(q.probs))


def _sampling_params(s: Sampling) -> SamplingParams:
    return SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, seed=s.seed)

