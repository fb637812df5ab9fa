"""The one approximate tokeniser that the gateway and the emulator share.

Real tokenisers need model files; routing only needs a token count and prefix block hashes
that agree between the router's estimate and the engine's cache. The rule:

- a prompt's text is its UTF-8 bytes; every 4 bytes are one token (English averages about
  4 characters a token with Llama-family tokenisers), the last token possibly shorter;
- a chat request's text is its messages rendered as ``<|role|>\\n{content}\\n`` each, in
  order, followed by ``<|assistant|>\\n``;
- block ``i`` holds tokens ``16i .. 16i+15``; its hash chains the previous block's hash
  with its 64 bytes (BLAKE2b, 64 bits, top bit cleared). Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

BYTES_PER_TOKEN = 4
BLOCK_TOKENS = 16
_BLOCK_BYTES = BYTES_PER_TOKEN * BLOCK_TOKENS


def count_tokens(text: str) -> int:
    return -(-len(text.encode()) // BYTES_PER_TOKEN)


def block_hashes(text: str) -> tuple[int, ...]:
    data = text.encode()
    hashes = []
    parent = b"\0" * 8
    for start in range(0, len(data) - _BLOCK_BYTES + 1, _BLOCK_BYTES):
        digest = hashlib.blake2b(parent + data[start : start + _BLOCK_BYTES], digest_size=8)
        parent = digest.digest()
        hashes.append(int.from_bytes(parent) >> 1)
    return tuple(hashes)


def chat_text(messages: Iterable[Mapping[str, object]]) -> str:
    """The prompt text of chat messages; non-text content parts count by their text."""
    parts = [f"<|{m.get('role', 'user')}|>\n{_content(m.get('content'))}\n" for m in messages]
    return "".join(parts) + "<|assistant|>\n"


def _content(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""
