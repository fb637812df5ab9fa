"""The one approximate tokeniser that the gateway and the emulator share.

Real tokenisers need model files; routing only needs a token count and prefix block hashes
that agree between the router's estimate and the engine's cache. The rule:

- a prompt's text is its UTF-8 bytes; every 4 bytes are one token (English averages about
  4 characters a token with Llama-family tokenisers), the last token possibly shorter;
- a chat request's text is its tools' JSON (``<|tools|>\\n{json}\\n``, first, as chat
  templates write them into the system turn), then its messages rendered as
  ``<|role|>\\n{content}{tool calls' JSON}\\n`` each, in order, followed by
  ``<|assistant|>\\n``;
- block ``i`` holds tokens ``16i .. 16i+15``; its hash chains the previous block's hash
  with its 64 bytes (BLAKE2b, 64 bits, top bit cleared). Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence

BYTES_PER_TOKEN = 4
BLOCK_TOKENS = 16
_BLOCK_BYTES = BYTES_PER_TOKEN * BLOCK_TOKENS
MAX_TOKEN_ID = (1 << (8 * BYTES_PER_TOKEN)) - 1


def count_tokens(text: str) -> int:
    return -(-len(text.encode()) // BYTES_PER_TOKEN)


def block_hashes(text: str) -> tuple[int, ...]:
    return _chained(text.encode())


def prompt_block_hashes(prompt: str | Sequence[int]) -> tuple[int, ...]:
    """The block hashes of one prompt: of its text, or of its token ids' bytes as
    ``token_ids`` writes them (an id outside 0..``MAX_TOKEN_ID`` wraps), so that a text's
    ids hash as its text does: an engine caches by the tokens, however they were sent."""
    if isinstance(prompt, str):
        return block_hashes(prompt)
    return _chained(b"".join((i & MAX_TOKEN_ID).to_bytes(BYTES_PER_TOKEN) for i in prompt))


def _chained(data: bytes) -> tuple[int, ...]:
    hashes = []
    parent = b"\0" * 8
    for start in range(0, len(data) - _BLOCK_BYTES + 1, _BLOCK_BYTES):
        digest = hashlib.blake2b(parent + data[start : start + _BLOCK_BYTES], digest_size=8)
        parent = digest.digest()
        hashes.append(int.from_bytes(parent) >> 1)
    return tuple(hashes)


def chat_text(
    messages: Iterable[Mapping[str, object]], tools: Sequence[object] | None = None
) -> str:
    """The prompt text of chat messages; non-text content parts count by their text, tools
    and tool calls by their JSON (a chat template writes both into the prompt: fifty
    tools' schemas are thousands of tokens, and a fixed tool list is a shared prefix)."""
    head = f"<|tools|>\n{_json(tools)}\n" if tools else ""
    parts = [
        f"<|{m.get('role', 'user')}|>\n{_content(m.get('content'))}{_calls(m)}\n" for m in messages
    ]
    return head + "".join(parts) + "<|assistant|>\n"


def _calls(message: Mapping[str, object]) -> str:
    calls = message.get("tool_calls")
    return _json(calls) if calls else ""


def _json(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def _content(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def prompt_tokens(prompt: str | Sequence[int]) -> int:
    """Tokens of one prompt: text by the rule above, token ids as given."""
    return count_tokens(prompt) if isinstance(prompt, str) else len(prompt)


def token_ids(text: str) -> list[int]:
    """The rule's tokens as ids: each token's bytes as a big-endian number, a short last
    token padded with zero bytes (so ``token_text`` gives the text back)."""
    data = text.encode()
    return [
        int.from_bytes(data[start : start + BYTES_PER_TOKEN].ljust(BYTES_PER_TOKEN, b"\0"))
        for start in range(0, len(data), BYTES_PER_TOKEN)
    ]


def token_text(ids: Iterable[int]) -> str:
    """The text of ``token_ids``' ids (OverflowError for one outside 0..``MAX_TOKEN_ID``)."""
    data = b"".join(i.to_bytes(BYTES_PER_TOKEN).rstrip(b"\0") for i in ids)
    return data.decode(errors="replace")
