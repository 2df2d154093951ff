"""The endpoints' work over one model and its engine (`API`): checking a request against the
model, queueing it, and answering it whole or as server-sent events. `app` routes HTTP to it.

Rendering the chat template and tokenizing run in worker threads, off the event loop. A client
that disconnects cancels its request, streamed or not: the engine frees its slot at its next
turn.
"""

from __future__ import annotations

import asyncio
import json
import math
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request as HTTPRequest

from q8rules.engine.scheduler import (
  DoneEvent,
  EngineDown,
  ErrorEvent,
  Request,
  Scheduler,
  TokenEvent,
)
from q8rules.serve import protocol as P
from q8rules.serve import responses as R
from q8rules.serve import tool_replies as T
from q8rules.serve.errors import APIError

MAX_BODY = 4 << 20
"""The largest request body read (bytes); a larger one gets 413."""


GONE = object()
"""Put on a request's event queue when its client disconnects."""


def sse(data: Any) -> str:
  """One server-sent event carrying `data` as JSON (or the literal '[DONE]')."""
  return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class API:
  """The endpoints over one model and its engine.

  Args:
    model: the `GGUFModel` served (its tokenizer, chat template and config).
    scheduler: the engine (`q8rules.engine.scheduler.Scheduler`), started.
    name: the model's id in `/v1/models` and in responses; a request naming another model
      gets 404.
    timeout: the most seconds a completion request may take from its arrival to its last
      token (None: no limit); past it, it is cancelled and answered 503.
  """

  def __init__(self, model: Any, scheduler: Scheduler, name: str, timeout: float | None = None):
    self.model = model
    self.scheduler = scheduler
    self.name = name
    self.timeout = timeout
    self.created = int(time.time())
    self.context = scheduler.runner.context
    self.vocab = model.config.vocab
    self.metrics = scheduler.metrics
    tok = model.tokenizer
    self.stop_ids = frozenset(tok.eog_ids) if tok is not None else frozenset()
    from q8rules.llm.chat import TEMPLATE_KEY
    from q8rules.llm.tools import syntax_for_template

    template = model.metadata.get(TEMPLATE_KEY)
    self.syntax = syntax_for_template(template) if isinstance(template, str) else None
    """The tool-call syntax the model's chat template writes (`q8rules.llm.tools`), or None."""

  def count_error(self, status: int) -> None:
    self.metrics.http_errors.labels(status=str(status)).inc()

  # --- checks ---------------------------------------------------------------------------------

  def check_model(self, model: str | None) -> None:
    names = {self.name, Path(self.name).stem, ""}
    if model is not None and model not in names:
      raise APIError(
        404, f"the model '{model}' is not served here; this server serves '{self.name}'",
        param="model", code="model_not_found",
      )  # fmt: skip

  def check_vocab(self, body: Any) -> None:
    """`top_k` and the `logit_bias` ids within the vocabulary (APIError 400 naming them)."""
    if body.top_k is not None and body.top_k > self.vocab:
      raise APIError(
        400, f"top_k: {body.top_k} is more than the vocabulary's {self.vocab} ids", param="top_k"
      )
    bad = [i for i in body.bias() if i >= self.vocab]
    if bad:
      raise APIError(
        400, f"logit_bias: token ids {bad[:5]} lie outside the vocabulary [0, {self.vocab})",
        param="logit_bias",
      )  # fmt: skip

  def tokenizer(self) -> Any:
    if self.model.tokenizer is None:
      raise APIError(400, f"{self.name}: no tokenizer could be built; send token ids")
    return self.model.tokenizer

  def check_ids(self, ids: list[int], limit: int | None, param: str) -> int:
    """The number of tokens to generate: `limit`, or what the context leaves (APIError 400
    naming `param` (the prompt's field) when the prompt is empty, has an id outside the
    vocabulary or fills the context, or `max_tokens` when the prompt and `limit` do not fit)."""
    if not ids:
      raise APIError(400, f"{param}: the prompt is empty", param=param)
    bad = [i for i in ids if not 0 <= i < self.vocab]
    if bad:
      raise APIError(
        400, f"{param}: token ids {bad[:5]} lie outside [0, {self.vocab})", param=param
      )
    if len(ids) >= self.context:
      raise APIError(
        400, f"{param}: the prompt's {len(ids)} tokens fill the context of {self.context} tokens;"
        " nothing is left to generate", param=param, code="context_length_exceeded",
      )  # fmt: skip
    if limit is None:
      return self.context - len(ids)
    if len(ids) + limit > self.context:
      raise APIError(
        400, f"max_tokens: the prompt's {len(ids)} tokens and max_tokens {limit} exceed the"
        f" context of {self.context} tokens", param="max_tokens", code="context_length_exceeded",
      )  # fmt: skip
    return limit

  # --- prompts (in worker threads) ------------------------------------------------------------

  def tool_syntax(self) -> Any:
    """The tool-call syntax the model's chat template writes (`q8rules.llm.tools`); APIError
    400 naming `tools` when it writes none."""
    if self.syntax is None:
      raise APIError(
        400, f"tools: the chat template of {self.name} defines no tool calls (it renders no"
        " tools and no call syntax is known for it); leave tools out, or serve a model whose"
        " template defines them", param="tools",
      )  # fmt: skip
    return self.syntax

  def chat_ids(self, body: P.ChatCompletionRequest, tools: list | None = None) -> list[int]:
    """The chat template over `body.messages` (and `tools`, when given), tokenized."""
    from q8rules.llm.chat import ChatTemplateError

    self.tokenizer()
    messages = [m.as_template_input() for m in body.messages]
    try:
      return list(self.model.apply_chat_template(messages, add_generation_prompt=True, tools=tools))
    except ChatTemplateError as e:
      raise APIError(400, str(e), param="messages", code="template_error") from None
    except UnicodeError as e:
      raise APIError(
        400, f"messages: the text is not valid Unicode ({e})", param="messages"
      ) from None
    except ValueError as e:  # a message the renderer refuses
      raise APIError(400, str(e), param="messages") from None

  def grammar(self, body: Any, tools: Any = None) -> Any:
    """The matcher of the grammar `body`'s structured-output fields ask for, or of the call
    a required or named `tool_choice` makes (`tools`: (syntax, the tools' template form)), or
    None (APIError 400 naming the field that does not compile)."""
    fields = body.constraint()
    forced = tools is not None and body.tool_mode() in ("required", "named")
    if not fields and not forced:
      return None
    from q8rules.llm.grammar import GrammarError, RowMatcher, grammar_for_request
    from q8rules.llm.tools.grammar import call_grammar

    tok = self.tokenizer()
    if forced and fields:
      raise APIError(
        400, f"tool_choice: a required tool call and {next(iter(fields))} cannot both constrain"
        " the reply", param="tool_choice",
      )  # fmt: skip
    try:
      if forced:
        syntax, entries = tools
        only = body.tool_choice.function.name if body.tool_mode() == "named" else None
        parallel = body.parallel_tool_calls is not False
        return RowMatcher(
          call_grammar(syntax.name, entries, tok, only=only, parallel=parallel), tok
        )
      return RowMatcher(grammar_for_request(tok, **fields), tok)
    except GrammarError as e:
      raise APIError(400, str(e), param=e.field) from None
    except ImportError as e:
      raise APIError(
        400, f"structured output needs llguidance (pip install 'q8rules[serve]'): {e}",
        param=next(iter(fields), "tool_choice"),
      ) from None  # fmt: skip

  def completion_ids(self, body: P.CompletionRequest) -> list[int]:
    """The prompt's ids: `body.prompt` tokenized, or as given."""
    if not isinstance(body.prompt, str):
      return list(body.prompt)
    tok = self.tokenizer()
    try:
      ids = tok.encode(body.prompt)
    except UnicodeError as e:
      raise APIError(400, f"prompt: the text is not valid Unicode ({e})", param="prompt") from None
    return ids or ([tok.bos_id] if tok.bos_id is not None else [])

  def tokenize(self, body: P.TokenizeRequest) -> dict[str, Any]:
    tok = self.tokenizer()
    try:
      ids = tok.encode(body.content, add_special=body.add_special, parse_special=True)
    except UnicodeError as e:
      raise APIError(
        400, f"content: the text is not valid Unicode ({e})", param="content"
      ) from None
    if not body.with_pieces:
      return {"tokens": ids}
    return {"tokens": [{"id": i, "piece": tok.decode([i], special=True)} for i in ids]}

  def detokenize(self, body: P.DetokenizeRequest) -> dict[str, Any]:
    bad = [i for i in body.tokens if not 0 <= i < self.vocab]
    if bad:
      raise APIError(400, f"tokens: ids {bad[:5]} lie outside [0, {self.vocab})", param="tokens")
    return {"content": self.tokenizer().decode(body.tokens)}

  # --- completions ----------------------------------------------------------------------------

  def logprob_entries(self, logprobs: list[tuple[int, float, list[tuple[int, float]]]]) -> list:
    def piece(i: int) -> str:
      tok = self.model.tokenizer
      return tok.decode([i], special=True) if tok is not None else f" {i}"

    def entry(i: int, lp: float) -> dict[str, Any]:
      text = piece(i)
      return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    return [
      {**entry(i, lp), "top_logprobs": [entry(j, v) for j, v in top]} for i, lp, top in logprobs
    ]

  async def complete(self, http: HTTPRequest, body: Any, chat: bool) -> Response:
    """A chat or text completion: checked, tokenized off the loop, run by the engine."""
    arrived = time.perf_counter()
    self.check_model(body.model)
    self.check_vocab(body)
    tools, stops = None, body.stops()
    if chat and body.tool_mode() != "none":
      tools = (self.tool_syntax(), [t.as_template_input() for t in body.tools])
      one_call = T.ONE_CALL_STOP.get(tools[0].name)
      if one_call and body.tool_mode() == "auto" and body.parallel_tool_calls is False:
        stops.append(one_call)
    if chat:
      ids = await run_in_threadpool(self.chat_ids, body, tools and tools[1])
    else:
      ids = await run_in_threadpool(self.completion_ids, body)
    limit = self.check_ids(ids, body.limit(), "messages" if chat else "prompt")
    grammar = await run_in_threadpool(self.grammar, body, tools)
    want, top = body.logprob_settings()
    try:
      params = body.sampling(secrets.randbits(31), want, top)
    except ValueError as e:
      raise APIError(400, str(e)) from None
    loop = asyncio.get_running_loop()
    queue, emit = Request.queue_for(loop)
    rid = R.new_id("chatcmpl" if chat else "cmpl")
    stop_ids = frozenset() if body.ignore_eos else self.stop_ids
    request = Request(
      ids, limit, params, stops, stop_ids, emit, rid=rid, arrived=arrived, grammar=grammar,
      special=tools is not None,
    )  # fmt: skip
    syntax = tools[0] if tools is not None else None
    try:
      self.scheduler.submit(request)
    except EngineDown as e:
      raise APIError(503, str(e)) from None
    timer = None
    if self.timeout is not None:
      left = max(0.0, self.timeout - (time.perf_counter() - arrived))
      timer = loop.call_later(left, self._expire, request, queue)
    if body.stream:
      return StreamingResponse(
        self.stream(request, queue, rid, chat, body.include_usage(), timer, syntax),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
      )
    try:
      return await self.whole(http, request, queue, rid, chat, want, syntax)
    finally:
      if timer is not None:
        timer.cancel()

  def _cancel(self, request: Request) -> None:
    request.cancel()
    self.scheduler.wake()

  def _expire(self, request: Request, queue: asyncio.Queue) -> None:
    """`request` ran past the timeout: cancelled, and its reader told (503)."""
    if request.ended:
      return
    self._cancel(request)
    message = f"the request ran past the server's timeout of {self.timeout:g} s and was cancelled"
    queue.put_nowait(ErrorEvent(message, 503))

  async def _watch(self, http: HTTPRequest, request: Request, queue: asyncio.Queue) -> None:
    """Wait for the client to disconnect (its body is in already): then cancel `request`."""
    while (await http.receive())["type"] != "http.disconnect":
      pass
    self._cancel(request)
    queue.put_nowait(GONE)

  async def whole(
    self,
    http: HTTPRequest,
    request: Request,
    queue: asyncio.Queue,
    rid: str,
    chat: bool,
    want: bool,
    syntax: Any = None,
  ) -> Response:
    text, entries = [], []
    watcher = asyncio.ensure_future(self._watch(http, request, queue))
    try:
      while True:
        event = await queue.get()
        if event is GONE:
          return Response(status_code=499)  # nobody reads it
        if isinstance(event, TokenEvent):
          text.append(event.text)
          entries.extend(self.logprob_entries(event.logprobs or []))
        elif isinstance(event, ErrorEvent):
          raise APIError(event.status, event.message)
        else:
          break
    except BaseException:  # an error, or the handler cancelled: the engine drops the request
      self._cancel(request)
      raise
    finally:
      watcher.cancel()
    done: DoneEvent = event
    text.append(done.text)
    content = "".join(text)
    finish = done.finish_reason
    if chat:
      message: dict[str, Any] = {"role": "assistant", "content": content}
      if syntax is not None:
        message, calls = T.message(syntax, content)
        finish = "tool_calls" if calls and finish == "stop" else finish
      choice = {"index": 0, "message": message}
      if want:
        choice["logprobs"] = R.chat_logprobs(entries)
      kind = "chat.completion"
    else:
      choice = {"index": 0, "text": content}
      choice["logprobs"] = R.completion_logprobs(entries, 0) if want else None
      kind = "text_completion"
    choice["finish_reason"] = finish
    out = R.base(kind, rid, self.name)
    out["choices"] = [choice]
    out["usage"] = R.usage(done.prompt_tokens, done.completion_tokens)
    return JSONResponse(out)

  async def stream(
    self,
    request: Request,
    queue: asyncio.Queue,
    rid: str,
    chat: bool,
    include_usage: bool,
    timer: asyncio.TimerHandle | None = None,
    syntax: Any = None,
  ) -> AsyncIterator[str]:
    kind = "chat.completion.chunk" if chat else "text_completion"
    offset = 0
    reader = T.DeltaReader(syntax) if syntax is not None else None

    def chunk(text: str | dict | None, finish: str | None, entries: list | None = None) -> dict:
      nonlocal offset
      out = R.base(kind, rid, self.name)
      if chat:
        delta = text if isinstance(text, dict) else {} if text is None else {"content": text}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        if entries:
          choice["logprobs"] = R.chat_logprobs(entries)
      else:
        choice = {"index": 0, "text": text or "", "finish_reason": finish}
        choice["logprobs"] = R.completion_logprobs(entries, offset) if entries else None
        offset += len(text or "")
      out["choices"] = [choice]
      if include_usage:
        out["usage"] = None
      return out

    ended = False
    try:
      if chat:
        first = chunk(None, None)
        first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        yield sse(first)
      while True:
        event = await queue.get()
        if isinstance(event, TokenEvent):  # with every token already queued: one write
          out = []
          while isinstance(event, TokenEvent):
            entries = self.logprob_entries(event.logprobs or [])
            if reader is None:
              out.append(sse(chunk(event.text, None, entries)))
            else:
              for i, delta in enumerate(reader.feed(event.text) or ([{}] if entries else [])):
                out.append(sse(chunk(delta, None, entries if i == 0 else None)))
            event = queue.get_nowait() if not queue.empty() else None
          yield "".join(out)
          if event is None:
            continue
        ended = True
        if isinstance(event, ErrorEvent):
          self.count_error(event.status)
          yield sse(APIError(event.status, event.message).body())
          yield sse("[DONE]")
          return
        finish = event.finish_reason
        if reader is not None:
          for delta in reader.feed(event.text) + reader.finish():
            yield sse(chunk(delta, None))
          finish = "tool_calls" if reader.calls and finish == "stop" else finish
        elif event.text:
          yield sse(chunk(event.text, None))
        yield sse(chunk(None if chat else "", finish))
        if include_usage:
          last = R.base(kind, rid, self.name)
          last["choices"] = []
          last["usage"] = R.usage(event.prompt_tokens, event.completion_tokens)
          yield sse(last)
        yield sse("[DONE]")
        return
    finally:
      if timer is not None:
        timer.cancel()
      if not ended:  # the client went away (or the server is closing the stream)
        self._cancel(request)

  # --- the rest -------------------------------------------------------------------------------

  def models(self) -> dict[str, Any]:
    c = self.model.config
    meta = {
      "arch": c.arch,
      "vocab": c.vocab,
      "n_ctx_train": c.context_length,
      "n_ctx": self.context,
    }
    card = {
      "id": self.name, "object": "model", "created": self.created, "owned_by": "q8rules",
      "meta": meta,
    }  # fmt: skip
    return {"object": "list", "data": [card]}

  def health(self) -> tuple[int, dict[str, Any]]:
    """(200, {"status": "ok", ...}) while the engine runs; (503, {"status": "error", "error":
    why, ...}) once it has stopped or failed."""
    s = self.scheduler
    out: dict[str, Any] = {
      "status": "ok" if s.alive else "error",
      "slots_idle": s.runner.slots - s.running,
      "slots_processing": s.running,
      "requests_waiting": s.queued,
    }
    if out["status"] == "ok":
      return 200, out
    out["error"] = (
      f"the engine failed ({s.failure_message()})" if s.failure else "the engine is not running"
    )
    return 503, out

  def retry_after(self) -> int:
    """Seconds a shed client should wait: the requests ahead of it over the slots, times the
    recent requests' mean duration (1 to 60)."""
    s = self.scheduler
    rounds = max(1.0, s.queued / s.runner.slots)
    return int(min(60, max(1, math.ceil(rounds * self.metrics.typical_duration()))))


__all__ = ["API", "GONE", "MAX_BODY", "sse"]
