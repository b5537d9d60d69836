"""Chat Completions streaming: a call's completion sent as Server-Sent Events while it is sampled.

With ``stream: true`` the gateway answers ``text/event-stream`` (framing by ``sse-starlette``) in
OpenAI's chunk shape: ``data: {"object": "chat.completion.chunk", "choices": [{"index", "delta",
"logprobs", "finish_reason"}], ...}`` events, then ``data: [DONE]``:

1. per choice, a first delta ``{"role": "assistant", "content": ""}``;
2. content deltas as tokens are sampled: the continuous batcher hands every decoding step's
   tokens to the call (:attr:`~flow_assets.serving.gateway.batcher.GenerationRequest.on_tokens`),
   so text arrives token by token; the dynamic batcher (vLLM, ``continuous=False``) answers
   whole completions, and the stream then carries the completion in one delta. Text is held back
   while it may still turn out to be something else (:func:`sendable`): the start of a tool call,
   a prefix of a ``stop`` string, trailing whitespace, an incomplete UTF-8 character;
3. when the completion is done, the rest of the content, then each tool call as OpenAI streams
   one: ``{"index", "id", "type", "function": {"name", "arguments": ""}}`` and then its
   ``arguments``. Calls are parsed out of the whole text, as without streaming (the policy writes
   them as text; their arguments are known once the call is closed);
4. a chunk per choice with an empty delta and its ``finish_reason``; with
   ``stream_options.include_usage`` every chunk has ``"usage": null`` and a last chunk with no
   choices carries the usage; ``data: [DONE]``.

With ``logprobs: true`` each chunk carries the log-probs of the tokens whose text it completes,
the rest with the last chunk of the choice: concatenated they are the non-streaming call's list.

What is captured does not depend on streaming: the completion is cut at stop strings and parsed
from the batcher's final rollouts by the same code as a non-streaming call, and the turn is
recorded once all of its content and tool calls have been handed to the server, before the
``finish_reason`` chunk. A client that disconnects before that leaves a turn recorded as not
delivered (:attr:`~flow_assets.serving.gateway.capture.Turn.delivered`), never trained, and its
generation is cancelled (:attr:`~flow_assets.serving.gateway.batcher.GenerationRequest.cancelled`):
the batch stops decoding it at the next token, and the turn records what was sampled until then.

Importing ``sse-starlette`` wraps uvicorn's ``Server.handle_exit`` (the library's own doing, on
import: the original handler still runs, and streams are ended when the server is asked to stop).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from sse_starlette import EventSourceResponse

from flow_assets.policy.tool_calls import ToolCallFormat, call_start


def sendable(text: str, stops: Sequence[str] | None, call_format: ToolCallFormat | None) -> int:
    """How many leading characters of a completion's text so far are certain to begin the final
    message content, whatever the rest of the completion is.

    Held back: everything from the first place a stop string occurs or may begin (a suffix that is
    a proper prefix of one), from where a tool call starts or may start
    (:func:`~flow_assets.policy.tool_calls.call_start`; ``call_format`` ``None`` when no tool is
    parsed), and trailing whitespace (``hermes`` strips the content around calls). In ``hermes``,
    a text that begins with whitespace is held whole: the content is stripped if a call follows.

    Args:
        text: the completion decoded so far (complete characters).
        stops: the request's stop strings.
        call_format: the policy's tool-call syntax, or ``None``.

    Returns:
        A length ``0 <= k <= len(text)``; it never decreases as ``text`` grows.
    """
    limit = len(text)
    for stop in stops or ():
        found = text.find(stop)
        if found >= 0:
            limit = min(limit, found)
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                limit = min(limit, len(text) - k)
                break
    if call_format is not None:
        if call_format == "hermes" and text[:1].isspace():
            return 0
        start = call_start(text, call_format)
        if start is not None:
            limit = min(limit, start)
    while limit > 0 and text[limit - 1].isspace():
        limit -= 1
    return limit


class ChoiceText:
    """One choice's completion as it is sampled: its text, decoded incrementally, and what of it
    (and of its log-probs) has been sent.

    Decoding re-decodes only a short window: the tokens since the last complete character plus the
    ones before them (decoders that drop a leading space or merge bytes see the same context as in
    the whole text). A window ending in U+FFFD (an incomplete UTF-8 character) waits for its next
    token.

    Args:
        decode: ``fn(ids) -> str``, the tokenizer's decoding without special tokens.
        stops / call_format: as :func:`sendable`.
    """

    def __init__(self, decode: Callable[[list[int]], str], stops: Sequence[str] | None, call_format: ToolCallFormat | None):
        self.decode, self.stops, self.call_format = decode, list(stops or ()), call_format
        self.ids: list[int] = []
        self.text = ""
        self._prefix = self._read = 0  # window start, and the end of the tokens already in text
        self._ends: list[tuple[int, int]] = []  # (tokens, characters): text after that many ids
        self.sent = 0  # characters sent
        self.sent_tokens = 0  # tokens whose log-probs were sent

    def push(self, ids: list[int]) -> tuple[str, int, int]:
        """Add sampled tokens.

        Returns:
            ``(delta, first, end)``: the text that may be sent now, and the tokens
            ``first .. end - 1`` whose text it completes (their log-probs go with it).
        """
        self.ids += ids
        before = self.decode(self.ids[self._prefix : self._read])
        after = self.decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
            self._ends.append((len(self.ids), len(self.text)))
        limit = max(self.sent, sendable(self.text, self.stops, self.call_format))
        delta, self.sent = self.text[self.sent : limit], limit
        first = self.sent_tokens
        for tokens, chars in self._ends:
            if chars <= self.sent:
                self.sent_tokens = max(self.sent_tokens, tokens)
        return delta, first, self.sent_tokens

    def rest(self, content: str | None, count: int) -> tuple[str, int, int, bool]:
        """What is left to send once the completion is final.

        Args:
            content: the final message content (``None``: none).
            count: the final completion's tokens (cut at a stop string).

        Returns:
            ``(delta, first, end, consistent)``: as :meth:`push`, and whether the text sent is a
            prefix of ``content`` (:func:`sendable` makes it one; ``False`` would mean a
            tokenizer whose decoding of a prefix is not a prefix of its decoding of the whole,
            and then ``delta`` is the content past the length sent).
        """
        content = content or ""
        sent = self.text[: self.sent]
        first, self.sent_tokens = self.sent_tokens, max(self.sent_tokens, count)
        return content[len(sent) :], first, self.sent_tokens, content.startswith(sent)


def chunk(header: dict[str, Any], choices: list[dict[str, Any]], include_usage: bool, usage: dict[str, int] | None = None) -> str:
    """One ``chat.completion.chunk`` as the JSON text of an SSE ``data`` field; ``header``: its
    ``id``, ``created``, ``model`` and ``system_fingerprint``."""
    body = {**header, "object": "chat.completion.chunk", "choices": choices}
    if include_usage:
        body["usage"] = usage
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


class ChatStream(EventSourceResponse):
    """The SSE response of one streamed call; ``on_close()`` runs once when the response is over,
    whether the stream ended, the client went away or sending failed (the gateway records an
    undelivered turn and ends the rollout's call there).

    Args:
        events: the ``data`` texts to send, in order.
        on_close: called once, last.
        headers: extra response headers.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None], headers: dict[str, str] | None = None):
        # no keep-alive pings: a completion's tokens come every few milliseconds, and a comment
        # line between chunks is one more thing each client's SSE parser must skip
        super().__init__(events, headers=headers, ping=0, sep="\n")
        self._on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

    def translated(self, translate: Callable[[AsyncIterator[str]], AsyncIterator[Any]]) -> "ChatStream":
        """The same call streamed in another API's event shape (the Responses and Messages APIs).

        ``translate`` receives this stream's ``data`` texts (Chat Completions chunks as JSON, an
        error body, ``[DONE]``) and yields what to send instead: texts or
        :class:`sse_starlette.ServerSentEvent` (which carry an ``event:`` name). Capture is
        unchanged: the turn is recorded when ``translate`` has pulled the chunk that follows the
        last tool call, and ``on_close`` still runs once, last.
        """
        return ChatStream(translate(self.body_iterator), self._on_close, headers={k: v for k, v in self.headers.items() if k.lower().startswith("x-flowopt")})


def token_queue(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Queue, Callable[[int, list[int], list[float]], None], Callable[[Any], None]]:
    """A queue the batcher's worker thread feeds: ``(queue, on_tokens, on_done)``. ``on_tokens``
    puts ``(choice index, ids, log-probs)``, ``on_done`` (a future's done-callback) puts ``None``;
    both hop to ``loop`` (``call_soon_threadsafe`` keeps their order) and do nothing once the loop
    is closed (the gateway stopped)."""
    queue: asyncio.Queue = asyncio.Queue()

    def put(item) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    return queue, lambda i, ids, lps: put((i, ids, lps)), lambda _future: put(None)
