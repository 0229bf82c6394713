"""The streamed chunks' fast path (:class:`~deviceops.nn.serving.openai.PieceChunks`): a text
piece's bytes are exactly :func:`~deviceops.nn.serving.openai.stream_chunk`'s, for any text
(quotes, backslashes, control characters, non-ASCII, the template's own marker), both
objects and any choice index."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from deviceops.nn.serving.openai import PieceChunks, stream_chunk


@settings(max_examples=120, deadline=None)
@given(piece=st.text(min_size=1), chat=st.booleans(), index=st.integers(0, 15),
       rid=st.text(min_size=1, max_size=30), model=st.text(max_size=30))
def test_piece_chunk_bytes_equal_stream_chunk(piece: str, chat: bool, index: int, rid: str,
                                              model: str) -> None:
    plain = PieceChunks(rid, chat, model, 1700000000, index)
    want = stream_chunk(rid, chat, model, 1700000000, piece, None, index=index)
    assert plain(piece) == want


def test_piece_chunk_carries_the_marker_text_itself() -> None:
    mark = PieceChunks._MARK
    for chat in (False, True):
        plain = PieceChunks(mark, chat, mark, 1, 0)  # even in the id and the model name
        assert plain(mark) == stream_chunk(mark, chat, mark, 1, mark, None)
        assert plain("x") == stream_chunk(mark, chat, mark, 1, "x", None)
        body = json.loads(plain(mark)[6:])
        assert body["model"] == mark and body["choices"][0]["finish_reason"] is None
